// Option validators of the lutb command line.
#pragma once

#include <charconv>
#include <cstdint>
#include <limits>
#include <string>
#include <system_error>
#include <type_traits>

#include <CLI/CLI.hpp>
#include <fmt/core.h>

namespace lutb::cli {

/// An integer option restricted to lo..hi (inclusive). Replaces CLI::NonNegativeNumber /
/// CLI::PositiveNumber, which print their bounds as doubles ("not in range 0.000000 to
/// 1797693134862315708...") and let CLI11 wrap "-1" into an unsigned option. The value is parsed
/// exactly as type T (std::from_chars, an optional leading '+'), so an overflowing or negative
/// unsigned input is reported, never wrapped. CLI11 prefixes the message with the option name:
///   --threads: -3 is outside the valid range 0..4096
///   --layers: 1.5 is not an integer (valid range 1..1024)
template <class T>
CLI::Validator IntRange(T lo, T hi) {
  static_assert(std::is_integral_v<T>);
  return CLI::Validator(
      [lo, hi](std::string& in) -> std::string {
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

/// Thread counts: 0 (all cores) .. 4096.
inline CLI::Validator ThreadCount() { return IntRange<int>(0, 4096); }

}  // namespace lutb::cli
