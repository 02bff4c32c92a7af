// Supervisor: runs a changing set of local worker processes and collects their output and exits.
// It is the process machinery under launch() (launcher.h, fixed set, first failure stops all) and
// under the elastic coordinator (workers join while others run, leave with exit 0, or die, and
// the survivors keep running). It holds no policy: the caller decides what an exit means.
//
// Workers. spawn() forks a worker (fork + execvpe, command[0] searched in the supervisor's PATH)
// at any time, also while others run. Each worker:
//  * has an id, unique for the supervisor's lifetime (a replacement is a new id);
//  * gets the environment: this process's environment read when the supervisor was constructed
//    (unless inherit_env is false), overridden by SupervisorOptions::env, overridden by
//    WorkerSpec::env;
//  * runs in its own process group (signals reach its children too), with stdin from /dev/null
//    (several processes cannot share a terminal's input, and a background group reading the
//    terminal would be stopped), and gets SIGKILL if this process dies (PDEATHSIG; Linux
//    fires it when the *thread* that called spawn() ends, so spawn from a long-lived thread) --
//    or SupervisorOptions::parent_death_signal instead, for workers that handle their
//    supervisor's death themselves (process/parent_watch.h);
//  * has its stdout and stderr read through pipes. Every complete line goes to its log file
//    <log_dir>/<log_name> (default rank<ID>.log; truncated at spawn unless append_log; stdout and
//    stderr together) and to console_fd as one write of "<prefix><line>\n" (default prefix
//    "[rank ID] ", none when prefix_console is false), so lines from different workers never mix
//    within a line. A last line without '\n' is completed with one; a line longer than 64 KiB is
//    cut into 64 KiB lines. The supervisor's own notices go to the console as "[<name>] ..." lines.
//
// Exits. poll() reaps workers and returns their exits. An exit is reported once the worker has
// been reaped AND its output has been read to the end, so its log file is complete when the
// caller sees the exit (output is cut 1 s after the reap when something outside its process
// group still holds the pipes open). Before the reap, whatever is left in the worker's process
// group gets SIGKILL: leftovers would hold its pipes open and outlive it. Each exit is reported
// exactly once, by poll(), stop() or stop_all(); until then the id is in running().
//
// Stopping. terminate(id) sends SIGTERM to the worker's process group and SIGKILL stop_timeout
// later (the SIGKILL is sent by whichever poll/stop/stop_all call runs past that deadline);
// kill(id) sends SIGKILL now. stop(id) and stop_all() do the same and wait for the exits.
// Everything the supervisor signals is marked stopped_by_launcher in its exit.
//
// Signals. While a supervisor lives it owns SIGINT, SIGTERM, SIGCHLD and SIGPIPE of this process:
// the caller's handlers are saved at construction and restored by the destructor; SIGPIPE is
// ignored (a closed console must not kill the supervisor and orphan its workers). A SIGINT or
// SIGTERM delivered to this process is handled by the next poll/stop/stop_all call: it is
// forwarded to every running worker's process group with SIGKILL stop_timeout later, and
// interrupted() becomes true (workers spawned later do not get it: check interrupted() before
// spawning). A second one, or one arriving after terminate_all()/stop_all() started a shutdown,
// sends SIGKILL to every running worker at once. Only one supervisor can live in a
// process at a time: constructing a second one waits until the first is destroyed (launches are
// serialised), and throws ConfigError when the first lives on the calling thread (it would wait
// forever).
//
// Cleanup. The destructor sends SIGKILL to every running worker's process group, reaps all of
// them, closes every fd it opened and restores the signal handlers. Every wait is bounded except
// the reap after a SIGKILL (the kernel's job; immediate unless a process is stuck in the kernel).
//
// Not thread-safe: use one supervisor from one thread at a time.
#pragma once

#include <signal.h>
#include <sys/types.h>

#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace tessel::process {

struct SupervisorOptions {
  std::string log_dir;  // where workers' log files go (created if missing); empty: no log files
  int console_fd = 1;   // where console lines go (not closed); -1: nowhere
  bool prefix_console = true;  // "[rank ID] " before every console line (WorkerSpec may override)
  // After terminate()/stop()/stop_all()/a forwarded signal: how long a worker gets before SIGKILL.
  std::chrono::milliseconds stop_timeout{10000};
  std::string name = "supervisor";  // notices go to the console as "[name] ..."
  // false: the first SIGINT/SIGTERM is not forwarded, only recorded (interrupted()); the caller
  // stops the workers its own way. A second one still sends SIGKILL to every worker.
  bool forward_interrupts = true;
  bool inherit_env = true;  // workers start from this process's environment (read at construction)
  // The signal every worker gets when this process dies (PR_SET_PDEATHSIG). SIGKILL by default:
  // nothing outlives its supervisor. Workers that must save what they hold first get another one:
  // `tessel train` gives its workers SIGHUP, which ends them until they watch it themselves
  // (process/parent_watch.h blocks it). 0: none (a worker then outlives this process unless it
  // watches it). Must be 0 or a valid signal number.
  int parent_death_signal = SIGKILL;
  std::map<std::string, std::string> env;  // added to (and overriding) the inherited environment
};

struct WorkerSpec {
  int id = 0;                              // >= 0, unique for the supervisor's lifetime
  std::vector<std::string> command;        // argv; command[0] is searched in PATH
  std::map<std::string, std::string> env;  // overrides the supervisor's environment
  std::string log_name;                    // file name in log_dir (no '/'); empty: "rank<ID>.log"
  bool append_log = false;                 // keep what the log file holds (else truncate)
  std::optional<std::string> console_prefix;  // empty optional: "[rank ID] " or nothing
};

struct WorkerExit {
  int id = 0;    // the worker's id
  int rank = 0;  // same as id (launch() uses ranks as ids)
  pid_t pid = -1;
  bool signaled = false;  // true: ended by `signal`; false: exited with `code`
  int code = 0;           // exit status when !signaled (127 when the command could not be run)
  int signal = 0;         // terminating signal when signaled
  bool core_dumped = false;
  bool could_not_run = false;  // exec failed; `exec_error` says why, code is 127
  std::string exec_error;      // strerror of the failed exec
  bool stopped_by_launcher =
      false;                 // the supervisor signalled it (stop/kill/forward) before it ended
  bool status_lost = false;  // reaped by someone else (a foreign waitpid(-1)); code is 255
  std::chrono::milliseconds wall{0};  // from spawn to reap

  bool ok() const { return !signaled && code == 0 && !status_lost; }
  // Ended by a signal of its own making (a fault, an abort), not one sent from outside.
  bool crashed() const {
    return signaled && (signal == SIGSEGV || signal == SIGBUS || signal == SIGFPE ||
                        signal == SIGILL || signal == SIGABRT || signal == SIGSYS);
  }
  // "exited with code 3", "was killed by signal 9 (SIGKILL)", "could not run 'x': No such file
  // or directory (exit code 127)", "was reaped by someone else; status unknown".
  std::string describe(const std::string& program = "") const;
};

class Supervisor {
 public:
  // Throws ConfigError for a negative stop_timeout or an env name that is empty or contains '=',
  // IoError when log_dir, /dev/null or the signal pipe cannot be opened.
  explicit Supervisor(SupervisorOptions options);
  // Kills (SIGKILL) and reaps every running worker; closes every fd; restores signal handlers.
  ~Supervisor();
  Supervisor(const Supervisor&) = delete;
  Supervisor& operator=(const Supervisor&) = delete;

  // Starts a worker and returns its pid once it has exec'd (or failed to: that is reported as an
  // exit with could_not_run and code 127, never thrown). Throws ConfigError for a negative or
  // already used id, an empty command, a bad env name or log_name; IoError when its log file, a
  // pipe or the process cannot be created.
  pid_t spawn(const WorkerSpec& spec);

  // Pumps every worker's output, handles due SIGKILL deadlines and received signals, reaps, and
  // returns the exits that became reportable (in reap order). Returns as soon as at least one
  // exit is reportable, a SIGINT/SIGTERM arrived or one of `wake_fds` is readable (the caller
  // consumes what made it so: the fds are only watched), else after `timeout` (0: one pass, no
  // wait).
  std::vector<WorkerExit> poll(std::chrono::milliseconds timeout,
                               const std::vector<int>& wake_fds = {});

  // SIGTERM to the worker's process group, SIGKILL stop_timeout later. False (nothing sent) when
  // the worker has already ended. Throws InvalidArgumentError for an id never spawned.
  bool terminate(int id);
  // SIGKILL to the worker's process group now; false when it has already ended.
  bool kill(int id);
  // terminate(id), then waits (pumping everyone's output) for its exit and returns it; exits of
  // others seen meanwhile are kept for the next poll(). Throws InvalidArgumentError for an id
  // never spawned or already reported.
  WorkerExit stop(int id);
  // terminate() for every running worker; marks a shutdown under way (a SIGINT/SIGTERM now sends
  // SIGKILL at once). Does not wait.
  void terminate_all();
  // terminate_all(), then waits for every worker to end; returns every exit not reported yet.
  std::vector<WorkerExit> stop_all();

  // Ids spawned and not yet reported by poll/stop/stop_all, ascending.
  std::vector<int> running() const;
  // Pid of a spawned worker (also after it ended); throws InvalidArgumentError for an unknown id.
  pid_t pid(int id) const;
  // True once a SIGINT/SIGTERM reached this process while the supervisor lived (and was handled
  // by a poll/stop/stop_all call); interrupt_signal() is the first such signal, 0 when none.
  bool interrupted() const;
  // True once terminate_all()/stop_all() ran or a second SIGINT/SIGTERM killed every worker.
  bool shutting_down() const;
  int interrupt_signal() const;

  // Why the console stopped taking lines (closed, full: "No space left on device"); empty while
  // it takes them. The workers' log files still hold every line.
  const std::string& console_error() const;

  // Writes "[name] text\n" to the console (nothing when there is none).
  void notice(const std::string& text);
  // The log file of a spawned worker ("" when there is no log_dir); throws InvalidArgumentError
  // for an unknown id.
  std::string log_path(int id) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// "SIGKILL" for 9; "signal 42" for a signal without a name.
std::string signal_name(int sig);

}  // namespace tessel::process
