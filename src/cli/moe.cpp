// PLACEHOLDER: replaced by the moe implementation (issue 5).
#include <stdexcept>
#include "cli/commands.hpp"
namespace lutb::cli {
void add_moe(CLI::App& app) {
  auto* cmd = app.add_subcommand("moe", "(not built yet)");
  cmd->callback([] { throw std::runtime_error("lutb moe is not implemented yet"); });
}
}  // namespace lutb::cli
