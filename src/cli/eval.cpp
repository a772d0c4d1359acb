// PLACEHOLDER: replaced by the eval implementation (issue 5).
#include <stdexcept>
#include "cli/commands.hpp"
namespace lutb::cli {
void add_eval(CLI::App& app) {
  auto* cmd = app.add_subcommand("eval", "(not built yet)");
  cmd->callback([] { throw std::runtime_error("lutb eval is not implemented yet"); });
}
}  // namespace lutb::cli
