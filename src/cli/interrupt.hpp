// Ctrl-C (SIGINT), SIGTERM and SIGHUP during the commands that write checkpoints.
#pragma once

#include "lutb/checkpoint.hpp"

namespace lutb::cli {

/// While alive, SIGINT, SIGTERM and SIGHUP no longer kill the process: the handler only stores the
/// signal number in interrupt_flag() (a lock-free atomic: async-signal-safe) and writes one line to
/// stderr. The writers poll the flag (QuantizeOptions::interrupt, SynthOptions::interrupt), throw
/// Interrupted, and their RAII guards remove the temporary output; main() then re-raises the signal
/// (reraise_interrupt), so the exit status is the usual "killed by SIGINT" (shell: 130; SIGTERM 143).
/// A second signal a second or more after the first kills at once (its temporary is then left behind,
/// and the next run reports it, see stale_temporaries()); one within a second is taken as the same
/// request delivered twice (GNU timeout and `kill -- -PGID` signal the process and then its group)
/// and ignored. A signal the parent set to
/// SIG_IGN (a background job's SIGINT, nohup's SIGHUP) stays ignored. The previous dispositions are
/// restored on destruction. One guard at a time.
class InterruptGuard {
 public:
  InterruptGuard();
  ~InterruptGuard();
  InterruptGuard(const InterruptGuard&) = delete;
  InterruptGuard& operator=(const InterruptGuard&) = delete;
};

/// The flag set by the handler (0: no signal yet).
const InterruptFlag* interrupt_flag();

/// Throws Interrupted when a signal arrived (for the default job's steps that are not writers).
void check_interrupted(const char* step);

/// Called by main() after an Interrupted reached it: restores the default action of `sig` and raises
/// it; exits with 128 + sig if the signal does not end the process.
[[noreturn]] void reraise_interrupt(int sig);

/// Prints a warning on stderr for each temporary of `target` left by a dead process (see
/// stale_temporaries()); they are not removed.
void warn_stale_temporaries(const std::filesystem::path& target);

}  // namespace lutb::cli
