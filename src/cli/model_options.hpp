// Options shared by `lutb eval` and `lutb moe`: how the routed experts are held and computed.
#pragma once

#include <string>

#include <CLI/CLI.hpp>
#include <fmt/core.h>

#include "lutb/fit.hpp"
#include "lutb/model.hpp"
#include "lutb/moe.hpp"

namespace lutb::cli {

inline std::string activation_name(moe::ActivationFormat a) { return a == moe::ActivationFormat::MXFP8 ? "mxfp8" : "bf16"; }

struct ModelQuantArgs {
  std::string quant = "none";
  std::string activations;  // empty = mxfp8 with LUT-B weights, bf16 otherwise
  std::string fitter;       // empty = the default fitter
  std::string kernel = "fast";

  /// Registers --quant, `act_flag` (--activations for eval, --act-format for moe), --fitter, --kernel.
  void add_to(CLI::App* cmd, const std::string& act_flag = "--activations") {
    cmd->add_option("--quant", quant, "routed experts: none (BF16), lutb, int3-g128, mxfp4")
        ->check(CLI::IsMember({"none", "lutb", "int3-g128", "mxfp4"}));
    cmd->add_option(act_flag, activations, "activations entering the expert GEMMs: bf16 or mxfp8 "
                                           "(default mxfp8 with LUT-B weights, bf16 otherwise)")
        ->check(CLI::IsMember({"bf16", "mxfp8"}));
    cmd->add_option("--fitter", fitter, "LUT-B fitter for the online method (default: the default fitter)");
    cmd->add_option("--kernel", kernel, "LUT-B emulation kernel: fast, reference, dequantized")
        ->check(CLI::IsMember({"fast", "reference", "dequantized"}));
  }

  model::MoeOptions resolve(int threads) const {
    model::MoeOptions o;
    o.quant = model::quant_from_name(quant);
    const std::string act = activations.empty() ? (o.quant == model::Quant::Lutb ? "mxfp8" : "bf16") : activations;
    o.activations = act == "mxfp8" ? moe::ActivationFormat::MXFP8 : moe::ActivationFormat::BF16;
    if (!fitter.empty() && o.quant != model::Quant::Lutb)
      throw std::invalid_argument(fmt::format("--fitter {} only applies to --quant lutb", fitter));
    if (!fitter.empty()) check_fitter_name(fitter);
    o.fit.fitter = fitter.empty() ? default_fitter() : fitter;
    o.fit.threads = threads;
    o.kernel = kernel == "reference" ? moe::EmulationKernel::Reference
               : kernel == "dequantized" ? moe::EmulationKernel::Dequantized
                                         : moe::EmulationKernel::Fast;
    return o;
  }
};

}  // namespace lutb::cli
