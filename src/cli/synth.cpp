// PLACEHOLDER: replaced by the synth implementation (issue 5).
#include <stdexcept>
#include "cli/commands.hpp"
namespace lutb::cli {
void add_synth(CLI::App& app) {
  auto* cmd = app.add_subcommand("synth", "(not built yet)");
  cmd->callback([] { throw std::runtime_error("lutb synth is not implemented yet"); });
}
}  // namespace lutb::cli
