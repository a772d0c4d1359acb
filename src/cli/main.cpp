// lutb: compress the routed experts of MoE language models to LUT-B and run them.
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <new>
#include <string>

#include <fmt/core.h>

#include "cli/commands.hpp"
#include "cli/interrupt.hpp"
#include "cli/usage_hints.hpp"
#include "cli/validators.hpp"

namespace {
constexpr const char* kUsageHint = "Run 'lutb --help' (or 'lutb COMMAND --help') for the options.";
}  // namespace

// Exit status (README "Exit status", lutb::cli::UsageError): 0 success; 1 the work failed; 2 a usage
// error (CLI11's parse errors and the tool's own option checks alike); 128 + the signal when
// interrupted.
int main(int argc, char** argv) {
  // Named "lutb": --help printed "Usage: /full/path/to/build/release/lutb quantize ..." (argv[0]).
  CLI::App app{"lutb: LUT-B (3.14-bit lookup-table weights, MXFP8 activations) for MoE experts", "lutb"};
  app.set_version_flag("--version", "lutb 0.1.0");
  app.footer(lutb::cli::kExitStatusHelp);
  lutb::cli::add_default_job(app);
  lutb::cli::add_quantize(app);
  lutb::cli::add_eval(app);
  lutb::cli::add_calibrate(app);
  lutb::cli::add_moe(app);
  lutb::cli::add_synth(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ExtrasError& e) {
    // Arguments nothing took: CLI11 listed them in reverse and said nothing of what is valid
    // ("The following arguments were not expected: 0 --threads"; new-user QA sessions 18-19).
    const std::string why = lutb::cli::explain_extras(app, argc, argv);
    fmt::print(stderr, "lutb: error: {}\n{}\n", why.empty() ? std::string(e.what()) : why, kUsageHint);
    return 2;
  } catch (const CLI::ParseError& e) {
    // --help and --version arrive here too, with exit code 0: CLI11 prints them.
    if (e.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) return app.exit(e);
    // A usage error: the same "lutb: error:" prefix as every other error, and exit status 2, the
    // convention for bad command lines (CLI11's own codes, 105-109, named nothing; nu16).
    fmt::print(stderr, "lutb: error: {}\n{}\n", e.what(), kUsageHint);
    return 2;
  } catch (const lutb::cli::UsageError& e) {
    // The tool's own option checks (a value that CLI11's validators cannot judge alone, options that
    // contradict each other): the same status and hint as CLI11's parse errors (new-user QA session 18:
    // they exited 1).
    fmt::print(stderr, "lutb: error: {}\n{}\n", e.what(), kUsageHint);
    return 2;
  } catch (const lutb::Interrupted& e) {
    // The writer's guards have removed its temporary output; end as the signal would have.
    fmt::print(stderr, "lutb: {}\n", e.what());
    lutb::cli::reraise_interrupt(e.signal);
  } catch (const std::bad_alloc&) {
    fmt::print(stderr, "lutb: error: out of memory (an allocation failed); try a smaller input or fewer tokens\n");
    return 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "lutb: error: {}\n", e.what());
    return 1;
  }
  // What a command prints reaches stdout when the buffer is flushed, at exit: `lutb moe --json >
  // /dev/full` (or with stdout closed) lost its results and exited 0 (new-user QA, session 21). A
  // script reading them must see the failure. The work itself (an output written) is done.
  errno = 0;
  if (std::fflush(stdout) != 0 || std::ferror(stdout)) {
    const int err = errno;
    fmt::print(stderr, "lutb: error: cannot write the results to standard output: {}; the work itself is done\n",
               err != 0 ? std::strerror(err) : "write error");
    return 1;
  }
  return 0;
}
