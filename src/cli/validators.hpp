// Option validators of the lutb command line.
#pragma once

#include <omp.h>
#include <sched.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <type_traits>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/core.h>

#include "io/checkpoint_internal.hpp"
#include "lutb/calibration.hpp"
#include "lutb/fit.hpp"
#include "lutb/safetensors.hpp"

namespace lutb::cli {

/// Exit status 2: the command line is wrong as such. The one convention of every lutb command
/// (docs/cli.md "Every command"; CLI11's parse errors exited 2 but the tool's own option checks
/// exited 1, so `--threads -1` and `--fitter nope` ended differently):
///  - 0: success;
///  - 1: the work failed: an input that is missing, unreadable or invalid (a corrupt file, a
///    config.json value, weights that contradict it), a destination that cannot be written or
///    replaced, too little free space or memory, no usable GPU;
///  - 2: a usage error, detected before any work: an unknown option or command, a missing or extra
///    argument, a value outside its allowed set or range, an empty name, an output named against what
///    it will be (check_file_output_name), options that contradict each other or do not apply to
///    this input (--fitter on stored LUT-B weights, --kernel without LUT-B experts, --reps without
///    --device cuda, --match with a checkpoint folder, --layer beyond the model's layers, ...);
///  - 130 / 143 / 129: interrupted by SIGINT / SIGTERM / SIGHUP (the signal's status; the output is left as it was).
/// main.cpp maps UsageError and CLI11's parse errors to 2, every other exception to 1. The message
/// names the option, as CLI11's do ("--threads: -3 is outside the valid range 0..4096").
struct UsageError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

/// An integer option restricted to lo..hi (inclusive). Replaces CLI::NonNegativeNumber /
/// CLI::PositiveNumber, which print their bounds as doubles ("not in range 0.000000 to
/// 1797693134862315708...") and let CLI11 wrap "-1" into an unsigned option. The value is parsed
/// exactly as type T (std::from_chars, an optional leading '+'), so an overflowing or negative
/// unsigned input is reported, never wrapped. CLI11 prefixes the message with the option name:
///   --threads: -3 is outside the valid range 0..4096
///   --layers: 1.5 is not an integer (valid range 1..1024)
///   --threads: an empty value was given; expected an integer 0..4096
template <class T>
CLI::Validator IntRange(T lo, T hi) {
  static_assert(std::is_integral_v<T>);
  return CLI::Validator(
      [lo, hi](std::string& in) -> std::string {
        // `--threads ""` read "--threads:  is not an integer".
        if (in.empty()) return fmt::format("an empty value was given; expected an integer {}..{}", lo, hi);
        const char* b = in.data();
        const char* e = in.data() + in.size();
        if (b != e && *b == '+') ++b;
        const auto all_digits = [](const char* x, const char* y) {
          if (x == y) return false;
          for (; x != y; ++x)
            if (*x < '0' || *x > '9') return false;
          return true;
        };
        // A negative number for an unsigned option: from_chars calls it invalid; it is out of range.
        if (std::is_unsigned_v<T> && b != e && *b == '-' && all_digits(b + 1, e))
          return fmt::format("{} is outside the valid range {}..{}", in, lo, hi);
        T v{};
        const auto [p, ec] = std::from_chars(b, e, v);
        if (ec == std::errc::result_out_of_range) return fmt::format("{} is outside the valid range {}..{}", in, lo, hi);
        if (ec != std::errc() || p != e || b == e) return fmt::format("{} is not an integer (valid range {}..{})", in, lo, hi);
        if (v < lo || v > hi) return fmt::format("{} is outside the valid range {}..{}", in, lo, hi);
        return {};
      },
      fmt::format("{}..{}", lo, hi));  // help: "--threads INT:0..4096"
}

/// A real option that must be finite and >= 0 (std::from_chars, an optional leading '+'). CLI11's
/// CLI::NonNegativeNumber accepts "nan" (NaN compares false with both bounds) and "inf".
///   --damping: -1 is not a finite number >= 0
inline CLI::Validator NonNegativeFinite() {
  return CLI::Validator(
      [](std::string& in) -> std::string {
        if (in.empty()) return "an empty value was given; expected a finite number >= 0";
        const char* b = in.data();
        const char* e = in.data() + in.size();
        if (*b == '+') ++b;
        double v = 0;
        const auto [p, ec] = std::from_chars(b, e, v);
        if (ec != std::errc() || p != e || b == e || !std::isfinite(v) || v < 0)
          return fmt::format("{} is not a finite number >= 0", in);
        return {};
      },
      "FLOAT>=0");
}

/// Thread counts: 0 (all cores) .. 4096; see effective_threads for more than the machine has.
inline CLI::Validator ThreadCount() { return IntRange<int>(0, 4096); }

/// Processors this process may run on (its affinity mask: what taskset / cgroup cpusets allow).
inline int available_processors() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
  const unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? static_cast<int>(n) : 1;
}

/// --threads as used: 0 stays 0 (all processors); more threads than available processors are
/// reduced to that number with a note on stderr, since oversubscribed OpenMP threads spin against
/// each other (a forward pass runs many times slower than on the available processors alone).
inline int effective_threads(int requested) {
  const int n = available_processors();
  if (requested <= n) return requested;
  fmt::print(stderr, "lutb: --threads {} is more than the {} processor{} available to this process; using {}\n",
             requested, n, n == 1 ? "" : "s", n);
  return n;
}

/// effective_threads(requested), made the OpenMP team size of this (the CLI's main) thread when it
/// is positive: the command owns its process, the library only reads the team size it is given.
inline int use_threads(int requested) {
  const int threads = effective_threads(requested);
  if (threads > 0) omp_set_num_threads(threads);
  return threads;
}

/// The fitter names for --help: "binned-dp, optimal, ct-lloyd, multistart (default binned-dp)".
inline std::string fitter_list() {
  std::string s;
  for (const auto& n : fitter_names()) s += (s.empty() ? "" : ", ") + n;
  return s + " (default " + default_fitter() + ")";
}

/// A fitter name from the command line, checked by the library (check_fitter_name); an unknown one is
/// a UsageError "--fitter: unknown fitter 'x'; allowed: binned-dp optimal ct-lloyd multistart".
inline void check_fitter_value(const std::string& name) {
  try {
    check_fitter_name(name);
  } catch (const std::invalid_argument& e) {
    throw UsageError(fmt::format("--fitter: {}", e.what()));
  }
}

/// A --fitter given on the command line (`opt` was used): an empty name is refused (`--fitter ""`
/// was taken as "not given", the default fitter), an unknown one too, as UsageError "--fitter: ..."
/// (exit status 2, before any work).
inline void check_fitter_option(const CLI::Option* opt, const std::string& name) {
  if (opt == nullptr || opt->count() == 0) return;
  if (name.empty()) {
    std::string msg = "--fitter: the fitter name is empty; allowed:";
    for (const auto& n : fitter_names()) msg += " " + n;
    throw UsageError(msg + " (leave --fitter out for the default, " + default_fitter() + ")");
  }
  check_fitter_value(name);
}

/// --error-feedback's help (quantize, eval, moe).
inline constexpr const char* kErrorFeedbackHelp =
    "with --calibration statistics that hold the full second moments (lutb calibrate --full-moments): on (default) "
    "fits with cross-column error feedback (GPTQ within the tiles, docs/calibration.md; CPU only), off with the "
    "column weights alone";

/// A --error-feedback given on the command line (`opt` was used) without --calibration: it chooses how
/// the statistics' full second moments are used, so without statistics it would change nothing
/// (UsageError, as --kernel without LUT-B experts).
inline void check_error_feedback_option(const CLI::Option* opt, const std::string& value,
                                        const std::string& calibration) {
  if (opt != nullptr && opt->count() > 0 && calibration.empty())
    throw UsageError(fmt::format("--error-feedback {} applies only with --calibration STATS (lutb calibrate); without "
                                 "statistics the fit is data-free",
                                 value));
}

/// --damping's help (quantize, eval, moe).
inline constexpr const char* kDampingHelp =
    "lambda of the error feedback's H = C + lambda mean(diag C) I (GPTQ's dampening; FitOptions::error_feedback, "
    "docs/calibration.md): larger is more stable on moments of few tokens and feeds back less (default 0.01; 0 "
    "needs positive definite moments)";

/// A --damping given on the command line (`opt` was used) where no error feedback can run: without
/// --calibration, or with --error-feedback off (UsageError: it would change nothing).
inline void check_damping_option(const CLI::Option* opt, double damping, const std::string& calibration,
                                 const std::string& error_feedback) {
  if (opt == nullptr || opt->count() == 0) return;
  if (calibration.empty())
    throw UsageError(fmt::format("--damping {} applies only with --calibration STATS of full second moments (lutb "
                                 "calibrate --full-moments); without statistics the fit is data-free",
                                 damping));
  if (error_feedback == "off")
    throw UsageError(fmt::format("--damping {} damps the error feedback, which --error-feedback off turns off", damping));
}

/// --device cuda with statistics that hold full second moments and --error-feedback on: the feedback
/// runs on the CPU only (FitOptions::error_feedback; the GPU fitters do not take it).
inline void check_gpu_error_feedback(const CalibrationStats* stats, bool error_feedback) {
  if (stats && error_feedback && stats->has_second_moments())
    throw UsageError(fmt::format("--calibration {}: the statistics hold full second moments, and the fit with "
                                 "cross-column error feedback runs on the CPU only; use --device cpu, or "
                                 "--error-feedback off for the GPU's fit with the column weights alone",
                                 stats->source));
}

/// Statistics of a layer under whose experts' prefix the checkpoint `dir` holds no tensor were
/// collected on another model (one with more layers, or a dense layer where this one has experts):
/// std::runtime_error naming the file, the layer and the checkpoint, as a routed-expert tensor that no
/// layer's statistics describe is refused. A checkpoint whose weights cannot be listed is left to the
/// loader, which words its error.
inline void check_statistics_layers(const CalibrationStats& stats, const std::filesystem::path& dir) {
  std::vector<std::string> names;
  try {
    names = SafetensorsCollection::open_dir(dir).names();
  } catch (const std::exception&) {
    return;
  }
  for (const auto& [layer, lc] : stats.layers) {
    const std::string p = lc.prefix + ".";
    if (std::none_of(names.begin(), names.end(), [&](const std::string& n) { return n.compare(0, p.size(), p) == 0; }))
      throw std::runtime_error(fmt::format("{}: layer {} ({}) has statistics, but {} holds no routed experts under "
                                           "that prefix (were they collected on this model?)",
                                           stats.source, layer, lc.prefix, dir.string()));
  }
}

/// --calibration needs a fitter with a weighted objective (FitOptions::column_weights).
inline void check_calibrated_fitter(const std::string& fitter) {
  if (!fitter.empty() && fitter != "binned-dp" && fitter != "optimal")
    throw UsageError(fmt::format("--fitter {} has no weighted objective; --calibration needs binned-dp or optimal",
                                 fitter));
}

/// A file or directory option given on the command line with an empty value (`--tokens ""`) was
/// taken as "not given" and its default used silently: refused, naming the option (UsageError).
inline void check_not_empty(const CLI::Option* opt, const std::string& value, const char* what) {
  if (opt != nullptr && opt->count() > 0 && value.empty())
    throw UsageError(fmt::format("{}: an empty {} was given", opt->get_name(), what));
}

/// The output's name says what it is, judged from the arguments alone, so a wrong one is a UsageError
/// in every command (the library refuses the same names with CheckpointError, for its own callers):
/// a file output is named *.safetensors, what quantize and eval read back, and a checkpoint folder
/// is not, since every reader takes that name for one file. The name as normalised for writing
/// ("out.safetensors/." is "out.safetensors", lutb::detail::output_path); messages quote it as typed.
inline bool named_safetensors(const std::string& output) {
  return lutb::detail::output_path(output).filename().extension() == ".safetensors";
}

/// -o of one file: UsageError "-o OUT: WHAT must be named *.safetensors (WHY)".
inline void check_file_output_name(const std::string& output, std::string_view what, std::string_view why) {
  if (!named_safetensors(output))
    throw UsageError(fmt::format("-o {}: {} must be named *.safetensors ({})", output, what, why));
}

/// -o of a checkpoint folder: UsageError "-o OUT: a checkpoint directory must not be named
/// *.safetensors (readers take that name for one safetensors file; REMEDY)".
inline void check_directory_output_name(const std::string& output, std::string_view remedy) {
  if (named_safetensors(output))
    throw UsageError(fmt::format("-o {}: a checkpoint directory must not be named *.safetensors (readers take that "
                                 "name for one safetensors file; {})",
                                 output, remedy));
}

}  // namespace lutb::cli
