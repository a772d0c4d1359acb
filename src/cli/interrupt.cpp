// Signal handling of the writing commands (see interrupt.hpp).
#include "cli/interrupt.hpp"

#include <signal.h>
#include <unistd.h>

#include <cerrno>
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

extern "C" void on_signal(int sig) {
  const int saved = errno;
  g_flag.store(sig, std::memory_order_relaxed);
  static const char msg[] =
      "\nlutb: interrupted: stopping and removing the partial output (a second signal stops at once and leaves it)\n";
  [[maybe_unused]] const ssize_t n = ::write(STDERR_FILENO, msg, sizeof msg - 1);
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
    sa.sa_flags = SA_RESETHAND | SA_RESTART;
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
