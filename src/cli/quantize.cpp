// PLACEHOLDER: replaced by the quantize implementation (issue 5).
#include <stdexcept>
#include "cli/commands.hpp"
namespace lutb::cli {
void add_quantize(CLI::App& app) {
  auto* cmd = app.add_subcommand("quantize", "(not built yet)");
  cmd->callback([] { throw std::runtime_error("lutb quantize is not implemented yet"); });
}
}  // namespace lutb::cli
