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

// Exit status (docs/cli.md "Every command", lutb::cli::UsageError): 0 success; 1 the work failed; 2
// a usage error (CLI11's parse errors and the tool's own option checks alike); 128 + the signal when
// interrupted.
int main(int argc, char** argv) {
  // Named "lutb", not argv[0]: --help shows "Usage: lutb quantize ...", not the build path.
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
    // Arguments nothing took: explained with what is valid there (CLI11 lists them in reverse and
    // says nothing of what is valid: "The following arguments were not expected: 0 --threads").
    const std::string why = lutb::cli::explain_extras(app, argc, argv);
    fmt::print(stderr, "lutb: error: {}\n{}\n", why.empty() ? std::string(e.what()) : why, kUsageHint);
    return 2;
  } catch (const CLI::ParseError& e) {
    // --help and --version arrive here too, with exit code 0: CLI11 prints them.
    if (e.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) return app.exit(e);
    // A usage error: the same "lutb: error:" prefix as every other error, and exit status 2, the
    // convention for bad command lines (CLI11's own codes, 105-109, mean nothing to a shell).
    fmt::print(stderr, "lutb: error: {}\n{}\n", e.what(), kUsageHint);
    return 2;
  } catch (const lutb::cli::UsageError& e) {
    // The tool's own option checks (a value that CLI11's validators cannot judge alone, options that
    // contradict each other): the same status and hint as CLI11's parse errors.
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
  // What a command prints reaches stdout when the buffer is flushed, at exit: a flush that fails
  // (`lutb moe --json > /dev/full`, stdout closed) loses the results, so it exits 1 and a script
  // reading them sees the failure. The work itself (an output written) is done.
  errno = 0;
  if (std::fflush(stdout) != 0 || std::ferror(stdout)) {
    const int err = errno;
    fmt::print(stderr, "lutb: error: cannot write the results to standard output: {}; the work itself is done\n",
               err != 0 ? std::strerror(err) : "write error");
    return 1;
  }
  return 0;
}
