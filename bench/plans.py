"""Plans as the events describe them, turned back into config text (shared by the benchmarks)."""


def parallel_of(described):
    """A `parallel:` block for a plan as events describe it ("dp=2 tp=1 pp=1 v=1 mb=6x1 1f1b
    zero0"). A reference run replays the very plans a run used: a recovery keeps the survivors'
    micro-batch size where the planner sees no cost in it, which a timeline entry of `workers: N`
    (the planner's plan for N) would not."""
    f = dict(w.split("=") for w in described.split() if "=" in w)
    words = described.split()
    return (f"{{dp: {f['dp']}, tp: {f['tp']}, pp: {f['pp']}, virtual_stages: {f['v']}, "
            f"micro_batch: {f['mb'].split('x')[0]}, schedule: {words[5]}, "
            f"zero_stage: {words[6].removeprefix('zero')}}}")


def timeline_entry(step, what):
    """A timeline entry at `step`: `what` is a worker count or a described plan."""
    if isinstance(what, int):
        return f"  - {{at_step: {step}, workers: {what}}}\n"
    return f"  - {{at_step: {step}, parallel: {parallel_of(what)}}}\n"


def workers_of(what):
    """The workers a timeline entry of timeline_entry() needs."""
    if isinstance(what, int):
        return what
    f = dict(w.split("=") for w in what.split() if "=" in w)
    return int(f["dp"]) * int(f["tp"]) * int(f["pp"])
