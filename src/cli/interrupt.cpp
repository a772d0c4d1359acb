// Signal handling of the writing commands (see interrupt.hpp).
#include "cli/interrupt.hpp"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <ctime>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <fmt/core.h>

namespace lutb::cli {

namespace {

InterruptFlag g_flag{0};
constexpr int kSignals[] = {SIGINT, SIGTERM, SIGHUP};
struct sigaction g_old[3];
bool g_installed[3] = {false, false, false};
// CLOCK_MONOTONIC nanoseconds of the first signal (0: none yet).
std::atomic<long long> g_first_ns{0};
static_assert(std::atomic<long long>::is_always_lock_free, "the signal handler needs a lock-free clock slot");
// A signal this soon after the first is the same request delivered twice: GNU timeout (without
// --foreground) and `kill -- -PGID` signal the process and then its whole group, and with
// SA_RESETHAND that second copy would kill the process at once, with no message and the temporary
// left behind.
constexpr long long kSameRequestNs = 1000000000LL;

long long monotonic_ns() {
  struct timespec ts {};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);  // async-signal-safe (POSIX)
  return static_cast<long long>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

void say(const char* msg, std::size_t n) { [[maybe_unused]] const ssize_t w = ::write(STDERR_FILENO, msg, n); }

extern "C" void on_signal(int sig) {
  const int saved = errno;
  const long long now = std::max(monotonic_ns(), 1LL);
  long long first = 0;
  if (g_first_ns.compare_exchange_strong(first, now)) {
    g_flag.store(sig, std::memory_order_relaxed);
    static const char msg[] =
        "\nlutb: interrupted: stopping and removing the partial output (a second signal, a second or more later, "
        "stops at once and leaves it)\n";
    say(msg, sizeof msg - 1);
  } else if (now - first >= kSameRequestNs) {
    // A second request: end now. The default action is restored and the signal raised again; it is
    // delivered when this handler returns (the signal is blocked while its handler runs).
    static const char msg[] = "\nlutb: second signal: stopping at once; the partial output is left behind\n";
    say(msg, sizeof msg - 1);
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    ::sigaction(sig, &dfl, nullptr);
    ::raise(sig);
  }
  errno = saved;
}

}  // namespace

InterruptGuard::InterruptGuard() {
  for (int i = 0; i < 3; ++i) {
    struct sigaction cur {};
    if (::sigaction(kSignals[i], nullptr, &cur) != 0 || cur.sa_handler == SIG_IGN) continue;
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    if (::sigaction(kSignals[i], &sa, &g_old[i]) == 0) g_installed[i] = true;
  }
}

InterruptGuard::~InterruptGuard() {
  for (int i = 0; i < 3; ++i)
    if (g_installed[i]) {
      ::sigaction(kSignals[i], &g_old[i], nullptr);
      g_installed[i] = false;
    }
}

const InterruptFlag* interrupt_flag() { return &g_flag; }

void check_interrupted(const char* step) {
  const int sig = g_flag.load(std::memory_order_relaxed);
  if (sig != 0) throw Interrupted(sig, fmt::format("interrupted by signal {} ({}) {}", sig, strsignal(sig), step));
}

void reraise_interrupt(int sig) {
  std::fflush(stdout);
  std::fflush(stderr);
  struct sigaction sa {};
  sa.sa_handler = SIG_DFL;
  sigemptyset(&sa.sa_mask);
  ::sigaction(sig, &sa, nullptr);
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, sig);
  ::sigprocmask(SIG_UNBLOCK, &set, nullptr);
  ::raise(sig);
  std::_Exit(128 + sig);
}

void warn_stale_temporaries(const std::filesystem::path& target) {
  for (const auto& p : stale_temporaries(target))
    fmt::print(stderr,
               "lutb: warning: {} was left by an interrupted run of a process that no longer exists; it is not "
               "used or removed (delete it when no other lutb writes {})\n",
               p.string(), target.string());
}

}  // namespace lutb::cli
