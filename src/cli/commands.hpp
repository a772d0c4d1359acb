// The lutb command-line tool: one file per subcommand, registered by main.cpp.
#pragma once

#include <CLI/CLI.hpp>

namespace lutb::cli {

/// `lutb` with no subcommand: the built-in default job (src/cli/default_job.cpp).
void add_default_job(CLI::App& app);
/// `lutb quantize` (src/cli/quantize.cpp).
void add_quantize(CLI::App& app);
/// `lutb eval` (src/cli/eval.cpp).
void add_eval(CLI::App& app);
/// `lutb moe` (src/cli/moe.cpp).
void add_moe(CLI::App& app);
/// `lutb calibrate` (src/cli/calibrate.cpp).
void add_calibrate(CLI::App& app);
/// `lutb synth` (src/cli/synth.cpp).
void add_synth(CLI::App& app);

}  // namespace lutb::cli
