// PLACEHOLDER: replaced by the default job (issue 5).
#include <stdexcept>
#include "cli/commands.hpp"
namespace lutb::cli {
void add_default_job(CLI::App& app) {
  app.callback([&app] {
    if (app.get_subcommands().empty()) throw std::runtime_error("default job not implemented yet");
  });
}
}  // namespace lutb::cli
