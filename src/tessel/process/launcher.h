// Local multi-process launcher (torchrun-like): spawns N workers of one command on this machine,
// gives each its rank in the environment, collects their output and stops them all together.
//
// What launch() does:
//  * Forks N workers (fork + execvpe, PATH searched with the launcher's PATH). Each worker gets
//    the launcher's environment plus, in this order of precedence (later wins):
//      OMP_NUM_THREADS = max(1, usable cores / nproc)  only when neither the launcher's
//                        environment nor extra_env sets it, so N workers do not each start one
//                        OpenMP thread per core and oversubscribe the machine;
//      extra_env;
//      RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, TESSEL_RANK, TESSEL_WORLD_SIZE,
//      TESSEL_JOB_ID, TESSEL_STORE_DIR (absolute), TESSEL_GENERATION=0.
//    Workers run in their own process group (signals reach the worker's children too), with
//    stdin from /dev/null (several processes cannot share a terminal's input, and a background
//    group reading the terminal would be stopped), and die with SIGKILL if the launcher dies
//    (parent_death_signal: another signal, for workers that save and leave on their own).
//  * Each worker's stdout and stderr are pipes. Every complete line goes to the rank's log file
//    <log_dir>/rank<R>.log (truncated at start; stdout and stderr together) and to console_fd
//    as one write of "[rank R] <line>\n" (no prefix when prefix_console is false), so lines from
//    different ranks never mix within a line. A last line without '\n' is completed with one;
//    a line longer than 64 KiB is cut into 64 KiB lines. The launcher's own notices go to the
//    console as "[launcher] ..." lines.
//  * The first worker that exits non-zero or by a signal is THE failure. The launcher waits
//    peer_grace (default 0) for the others to end on their own (e.g. with PeerLostError from
//    the collective layer), then sends SIGTERM to the others' process groups, then SIGKILL to
//    whatever is left stop_timeout later, reaps everyone and returns.
//  * SIGINT/SIGTERM received by the launcher during launch() are forwarded to every worker's
//    process group and start the same stop timeout; a second such signal (or one arriving while a
//    shutdown is already under way) sends SIGKILL at once. The caller's handlers for SIGINT,
//    SIGTERM, SIGCHLD and SIGPIPE are replaced during launch() (SIGPIPE ignored: a closed console
//    must not kill the launcher and orphan its workers) and restored before it returns.
//  * Every wait is bounded; when launch() returns (or throws) all workers have been reaped, their
//    process groups sent SIGKILL (no stray grandchildren), and every fd it opened is closed.
//    Launches in one process are serialised (the signal plumbing is process-wide), with each
//    other and with every Supervisor; launch() on a thread that holds a live Supervisor throws
//    ConfigError instead of waiting forever.
//
// launch() is a Supervisor (supervisor.h; it does the process, output and signal work described
// above) plus the policy "the first failure is THE failure; wait peer_grace; stop the rest".
//
// Exit code of the launch: 0 when every rank exited 0 and no signal interrupted the launcher;
// otherwise the failed rank's exit code (127 when its command could not be run), 128 + signal
// when it was killed by a signal, or 128 + signal when the launcher itself was interrupted.
#pragma once

#include <signal.h>
#include <sys/types.h>

#include <chrono>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "tessel/process/supervisor.h"  // WorkerExit, signal_name

namespace tessel::process {

struct LaunchOptions {
  int nproc = 1;       // number of workers; >= 1
  int world_size = 0;  // WORLD_SIZE / TESSEL_WORLD_SIZE given to workers; 0: nproc (on_tick may
                       // start more workers than nproc)
  std::vector<std::string> command;  // argv of every worker; command[0] is searched in PATH
  std::string log_dir;  // one file per rank, rank<R>.log (created if missing); empty: no files
  std::string job_id;   // TESSEL_JOB_ID; empty: 12 random hex digits
  // Rendezvous directory for Gloo's FileStore (TESSEL_STORE_DIR). Empty: a fresh directory
  // (tessel-store-<launcher pid>-<job>-*; one whose launcher is gone -- killed before it could
  // remove it -- is removed by the next launch that makes one in the same place)
  // under log_dir (or $TMPDIR, /tmp when log_dir is empty), removed when launch() returns. A
  // given directory is created if missing and left in place.
  std::string store_dir;
  // false: no store directory and no TESSEL_STORE_DIR (the workers rendezvous through a control
  // store, as those of `tessel train` do).
  bool file_store = true;
  // After a failure or forwarded signal: how long the others get after SIGTERM before SIGKILL.
  std::chrono::milliseconds stop_timeout{10000};
  // After a failure: how long the others may take to end by themselves before SIGTERM.
  std::chrono::milliseconds peer_grace{0};
  bool prefix_console = true;  // "[rank R] " before every console line
  int console_fd = 1;          // where console lines go (not closed); -1: nowhere
  std::map<std::string, std::string> extra_env;
  // The signal every worker gets when the launcher dies (SupervisorOptions::parent_death_signal):
  // SIGKILL unless the workers handle the launcher's death themselves (`tessel train` with the
  // embedded control store: they save and leave, process/parent_watch.h).
  int parent_death_signal = SIGKILL;
  // Workers started later: called after every poll of the workers (at least every `tick`) with
  // a function that starts one more copy of `command` as rank `rank` (RANK, LOCAL_RANK and
  // TESSEL_RANK set to it) with extra environment variables. A rank may be started again after
  // its earlier worker ended (its log file is appended to). Used by `tessel train` to start the
  // workers a timeline's switch adds. Its exceptions end the launch like a failure.
  using Spawn = std::function<void(int rank, const std::map<std::string, std::string>& env)>;
  // What on_tick may do to the workers: start one more (spawn), or SIGKILL the running worker of
  // a rank (kill; false when none runs) -- a worker that stopped answering is fenced so. A
  // killed worker's exit comes back through on_exit like any other.
  struct Workers {
    Spawn spawn;
    std::function<bool(int rank)> kill;
  };
  // `job` holds the job id and store dir the workers see.
  std::function<void(const Workers& workers, const struct LaunchResult& job)> on_tick;
  std::chrono::milliseconds tick{1000};
  // on_tick also runs as soon as one of these is readable (on_tick consumes what made it so): a
  // coordinator acts on events instead of polling for them.
  std::vector<int> wake_fds;
  // SIGINT/SIGTERM to the launcher. Without on_interrupt: forwarded to every worker (see the
  // header comment). With it: not forwarded; on_interrupt(signal) is called once, on_tick and
  // on_exit go on as before (the workers are expected to save and exit by themselves), and the
  // workers still running interrupt_grace later are stopped (SIGTERM, SIGKILL stop_timeout
  // later). A second signal stops them at once (SIGKILL). The exit code is 128 + signal either
  // way.
  std::function<void(int signal)> on_interrupt;
  std::chrono::milliseconds interrupt_grace{30000};
  // Called for every worker exit (e.rank set) before the failure policy looks at it. Returning
  // true for a failed worker says the job goes on without it (the elastic coordinator recovers
  // from it): it is then not THE failure and the others keep running. The launch ends when no
  // worker runs after a round of exits and on_tick (which may start replacements).
  std::function<bool(const WorkerExit& e)> on_exit;
};

struct LaunchResult {
  int exit_code = 0;                // 0 when all ranks exited 0; see the header comment
  std::vector<WorkerExit> workers;  // indexed by worker (rank for the first nproc; later spawns
                                    // follow in spawn order)
  // The first failure, e.g. "rank 2 (pid 1234) was killed by signal 9 (SIGKILL)" or
  // "rank 1 (pid 1234) exited with code 3"; empty on success.
  std::string failure;
  int failed_rank = -1;   // rank named by `failure`; -1 on success or when the launcher was
                          // interrupted before any worker failed
  std::string job_id;     // the job id the workers saw
  std::string store_dir;  // the store dir the workers saw (removed already when it was default)
  // Why the console lost lines (Supervisor::console_error); empty when it got them all.
  std::string console_error;
};

// Runs the job to completion as described above. Throws ConfigError for bad options (nproc < 1,
// empty command, negative timeouts, an extra_env name that is empty or contains '='), IoError
// when the log or store directory, a log file, a pipe or a process cannot be created (workers
// already started are killed and reaped first). A worker's failure is reported in the result,
// never thrown.
LaunchResult launch(const LaunchOptions& options);

// OMP_NUM_THREADS the launcher gives each of nproc workers: max(1, usable cores / nproc), where
// usable cores is the size of this process's CPU affinity mask.
int default_omp_threads(int nproc);

}  // namespace tessel::process
