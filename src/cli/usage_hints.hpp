// Explanations of command lines that CLI11 rejects as "extras": arguments that no option or positional
// of the command took. CLI11's own message lists them in reverse order and names neither the command
// nor what would be valid ("The following arguments were not expected: 0 --threads" for `lutb
// --threads 0`; "... /tmp/x -o DIR qunatize" for a misspelt command).
#pragma once

#include <algorithm>
#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/core.h>

namespace lutb::cli {

/// The exit-status paragraph of every --help, and where the full reference is (docs/cli.md). CLI11
/// shows a subcommand's own footer in place of the app's, so commands with their own footer
/// (quantize, synth) append this to it: every --help ends with the exit statuses.
inline constexpr const char* kExitStatusHelp =
    "Exit status: 0 success; 1 the work failed (an input missing, unreadable or invalid, a destination that cannot "
    "be written, too little space or memory, no usable GPU); 2 a usage error (an unknown option, a value outside "
    "its range, options that contradict each other or do not apply), reported before any work; 130 / 143 / 129 "
    "interrupted by Ctrl-C / SIGTERM / SIGHUP (the output is left as it was). Every option, check and refusal, by "
    "command: docs/cli.md in the lutb source tree.";

/// The --help group of the default job's options (lutb with no command; src/cli/default_job.cpp).
inline constexpr const char* kDefaultJobGroup = "Default job (lutb with no subcommand)";

namespace detail {

/// Levenshtein distance of two short strings (option and command names).
inline std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diag = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

/// The closest of `names` to `word` within 2 edits (or one that is a prefix of the other, both at
/// least 3 characters: "evaluate" -> "eval"), else "".
inline std::string closest(const std::string& word, const std::vector<std::string>& names) {
  std::string best;
  std::size_t best_d = 3;
  for (const auto& n : names) {
    std::size_t d = edit_distance(word, n);
    if (d >= best_d && word.size() >= 3 && n.size() >= 3 && (n.rfind(word, 0) == 0 || word.rfind(n, 0) == 0)) d = 2;
    if (d < best_d) best_d = d, best = n;
  }
  return best;
}

/// The long (or else short) names of the options of `app` that appear in --help, optionally only those
/// of one group: "--tokens", "-o", ...
inline std::vector<std::string> option_names(const CLI::App& app, const char* group = nullptr) {
  std::vector<std::string> out;
  for (const CLI::Option* o : app.get_options()) {
    if (o->get_positional() && o->get_lnames().empty() && o->get_snames().empty()) continue;
    if (o->get_group().empty()) continue;  // hidden (e.g. eval's old --activations)
    if (group != nullptr && o->get_group() != group) continue;
    if (!o->get_lnames().empty()) out.push_back("--" + o->get_lnames().front());
    else if (!o->get_snames().empty()) out.push_back("-" + o->get_snames().front());
  }
  return out;
}

inline std::string join_names(const std::vector<std::string>& v, const char* last = "and") {
  std::string s;
  for (std::size_t i = 0; i < v.size(); ++i)
    s += (i == 0 ? "" : (i + 1 == v.size() ? fmt::format(" {} ", last) : std::string(", "))) + v[i];
  return s;
}

/// Does `app` itself (not its subcommands) have the option `name` ("--threads", "-o")?
inline bool has_option(const CLI::App& app, const std::string& name) {
  const CLI::Option* o = app.get_option_no_throw(name);
  return o != nullptr && !(o->get_positional() && o->get_lnames().empty() && o->get_snames().empty());
}

}  // namespace detail

/// The message for a CLI::ExtrasError of `app` (the lutb root, after a failed parse) and its command
/// line: the first argument that nothing took, explained in the context it was given in (the default
/// job, or the command whose arguments it follows), with what would be valid there:
///  - an option of other commands ("--threads is not an option of the default job (lutb with no
///    command); it is an option of lutb quantize, eval and moe: give it after the command name ..."),
///  - an option given before the command's name ("--threads must follow the command name ..."),
///  - an unknown option (with the closest valid name within 2 edits, and where the list is),
///  - an unknown command ("unknown command 'qunatize' (did you mean 'quantize'?) ..."),
///  - an extra positional argument of a command.
/// Returns "" when the arguments cannot be found (the caller then prints CLI11's message).
inline std::string explain_extras(const CLI::App& app, int argc, const char* const* argv) {
  const std::vector<std::string> extras = app.remaining(true);
  if (extras.empty()) return {};
  std::vector<const CLI::App*> commands = app.get_subcommands([](const CLI::App*) { return true; });
  std::vector<std::string> command_names;
  for (const CLI::App* c : commands) command_names.push_back(c->get_name());
  const std::vector<CLI::App*> parsed = app.get_subcommands();
  const CLI::App* cmd = parsed.empty() ? nullptr : parsed.front();
  // Positions in argv: the command's name, and the first argument nothing took (its first
  // occurrence: a value of another option could repeat it, which only shifts the context).
  const auto index_of = [&](const std::string& s, int from) {
    for (int i = from; i < argc; ++i)
      if (s == argv[i]) return i;
    return argc;
  };
  const int cmd_ix = cmd != nullptr ? index_of(cmd->get_name(), 1) : argc;
  const std::string& tok = extras.front();
  const int tok_ix = index_of(tok, 1);
  const bool in_cmd = cmd != nullptr && tok_ix > cmd_ix;
  const std::string dflt = "the default job (lutb with no command)";
  const std::string dflt_opts =
      fmt::format("the default job's options are {} (lutb --help)",
                  detail::join_names(detail::option_names(app, kDefaultJobGroup)));
  const std::string commands_list = detail::join_names(command_names);

  if (tok.size() > 1 && tok[0] == '-') {
    const std::string name = tok.substr(0, tok.find('='));
    std::vector<std::string> owners;
    const CLI::App* first_owner = nullptr;
    for (const CLI::App* c : commands)
      if (detail::has_option(*c, name)) {
        owners.push_back(c->get_name());
        if (first_owner == nullptr) first_owner = c;
      }
    const bool dflt_has = detail::has_option(app, name);
    if (!in_cmd && cmd != nullptr) {
      // `lutb --threads 4 eval DIR`: options before the command's name are the default job's.
      if (detail::has_option(*cmd, name))
        return fmt::format("{} must follow the command name: arguments before '{}' are options of {}; write lutb {} "
                           "... {} ...",
                           name, cmd->get_name(), dflt, cmd->get_name(), name);
      return fmt::format("{} is not an option of {} nor of lutb {}{}; lutb {} --help lists the options of lutb {}", name,
                         dflt, cmd->get_name(),
                         owners.empty() ? "" : fmt::format(" (it is an option of lutb {})", detail::join_names(owners)),
                         cmd->get_name(), cmd->get_name());
    }
    if (!in_cmd) {
      if (!owners.empty())
        return fmt::format("{} is not an option of {}; it is an option of lutb {}: give it after the command name "
                           "(e.g. lutb {} ... {} ...); {}",
                           name, dflt, detail::join_names(owners), first_owner->get_name(), name, dflt_opts);
      const std::string near = detail::closest(name, detail::option_names(app, kDefaultJobGroup));
      return fmt::format("unknown option {}{}; {}; the commands are {}", name,
                         near.empty() ? "" : fmt::format(" (did you mean {}?)", near), dflt_opts, commands_list);
    }
    std::vector<std::string> elsewhere = owners;
    elsewhere.erase(std::remove(elsewhere.begin(), elsewhere.end(), cmd->get_name()), elsewhere.end());
    for (auto& e : elsewhere) e = "lutb " + e;
    if (dflt_has) elsewhere.push_back(dflt);
    if (!elsewhere.empty())
      return fmt::format("{} is not an option of lutb {}; it is an option of {}; lutb {} --help lists the options of "
                         "lutb {}",
                         name, cmd->get_name(), detail::join_names(elsewhere), cmd->get_name(), cmd->get_name());
    const std::string near = detail::closest(name, detail::option_names(*cmd));
    return fmt::format("lutb {}: unknown option {}{}; lutb {} --help lists its options", cmd->get_name(), name,
                       near.empty() ? "" : fmt::format(" (did you mean {}?)", near), cmd->get_name());
  }
  if (!in_cmd) {
    const std::string near = detail::closest(tok, command_names);
    return fmt::format("unknown command '{}'{}; the commands are {} ({} runs the built-in example)", tok,
                       near.empty() ? "" : fmt::format(" (did you mean '{}'?)", near), commands_list,
                       "lutb with no command");
  }
  std::vector<std::string> positionals;
  for (const CLI::Option* o : cmd->get_options())
    if (o->get_positional() && o->get_lnames().empty() && o->get_snames().empty())
      positionals.push_back(fmt::format("{}", o->get_name()));
  return fmt::format("lutb {}: unexpected argument '{}': lutb {} takes {} positional argument{} ({}); quote a name "
                     "that holds spaces",
                     cmd->get_name(), tok, cmd->get_name(), positionals.size() == 1 ? "one" : fmt::format("{}", positionals.size()),
                     positionals.size() == 1 ? "" : "s", detail::join_names(positionals));
}

}  // namespace lutb::cli
