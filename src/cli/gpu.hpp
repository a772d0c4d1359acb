// The CUDA backend as the lutb tool sees it (`--device cuda`): no CUDA type in this header. In a
// build without CUDA (the `cpu` preset, or no nvcc at configure time) every entry that needs the GPU
// throws kNoCudaBuild's message; src/cli/gpu.cpp is the only CLI source that includes lutb/cuda.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include <CLI/CLI.hpp>

#include "lutb/checkpoint.hpp"
#include "lutb/model.hpp"
#include "lutb/moe.hpp"

namespace lutb::cli {

/// Adds `--device cpu|cuda` (default cpu) to `cmd`, validated by CLI::IsMember; `what` says what runs
/// on the device.
CLI::Option* add_device_option(CLI::App* cmd, std::string& device, const std::string& what);

/// True when this lutb was built with the CUDA backend.
bool built_with_cuda();
/// "" when --device cuda can run here; otherwise the reason in words: "this lutb was built without
/// CUDA (configure with nvcc available, LUTB_CUDA=AUTO or ON)" or "no usable CUDA GPU (...)".
std::string cuda_unavailable_reason();
/// Throws std::runtime_error("--device cuda: " + cuda_unavailable_reason()) when that is not empty.
void require_cuda();
/// The GPU in words ("NVIDIA H200 (sm_90, 132 SMs, 139.8 GiB)"); require_cuda() first.
std::string cuda_device_description();

/// Throws UsageError (validators.hpp, exit status 2) with the library's message ("--fitter ct-lloyd:
/// fitter 'ct-lloyd' has no GPU kernel (GPU fitters: binned-dp, optimal); ...") when `fitter` ("" = the
/// default) has no GPU kernel; in a build without CUDA, std::runtime_error (kNoCudaBuild's message).
void check_gpu_fitter(const std::string& fitter);

/// The expert settings --device cuda has no path for, judged from the options alone, so that `lutb
/// eval` / `lutb moe` refuse them as usage errors (UsageError, exit status 2) before looking for a GPU,
/// on any machine: LUT-B experts with BF16 activations (the GPU runs LUT-B with MXFP8 activations,
/// spec section 4), BF16 experts (--quant none) with MXFP8 activations, and --quant int3-g128 / mxfp4.
/// GpuMoeBlock applies the same check.
void check_gpu_options(const model::MoeOptions& opt);

/// Time and weights of the GPU fits made through gpu_fit_function (for the weights/s line).
struct GpuFitTally {
  double seconds = 0;
  std::int64_t weights = 0;
};
/// A QuantizeOptions::FitFunction that fits on the GPU with lutb::cuda::quantize_gpu (same bytes as
/// lutb::quantize; its chunking bounds the device memory), adding each call's wall time and weights
/// to *tally. With FitOptions::column_weights (calibration) the GPU's weighted fit, the same bytes
/// as lutb::quantize with those weights. Errors are reworded "quantize: tensor ..." as lutb::quantize
/// words them. A stacked
/// tensor is fitted in groups of whole experts of at most 2^28 weights, and `fit.interrupt` is
/// polled between groups (Interrupted, as lutb::quantize throws it); the FitStats are then summed
/// group by group (the bytes do not depend on the grouping).
QuantizeOptions::FitFunction gpu_fit_function(std::shared_ptr<GpuFitTally> tally);

/// Where `lutb eval` / `lutb moe` fit the routed experts of a BF16 checkpoint to LUT-B (--quant lutb):
/// sets opt.fit_function to a timed fit and returns what to report. With `gpu` and a fitter that has
/// a GPU kernel (binned-dp, the default, or optimal): gpu_fit_function (lutb::cuda::quantize_gpu, the
/// CPU fitters' bytes and FitStats, so every result after the fit is unchanged); otherwise
/// lutb::quantize on the CPU, with `note` saying why when `gpu` ("fitter ct-lloyd has no GPU kernel
/// (GPU fitters: binned-dp, optimal)"). Nothing is set for other quants (no fit runs).
struct FitPlacement {
  bool fits = false;           // a LUT-B fit of BF16 weights runs at load (quant lutb)
  std::string device = "cpu";  // "cpu" or "cuda"
  std::string note;            // why a --device cuda run fits on the CPU, else ""
  std::shared_ptr<GpuFitTally> tally = std::make_shared<GpuFitTally>();  // wall time and weights of the fits
};
FitPlacement place_fit(model::MoeOptions& opt, bool gpu);
/// The "fit" line of eval / moe: "fit          cuda (binned-dp): 0.052 s for 3145728 weights (6.05e+07
/// weights/s, host-device copies included)", with the note when a --device cuda run fitted on the CPU.
void print_fit_line(const FitPlacement& f, const std::string& fitter);
/// JSON keys fit_device ("cpu" / "cuda"), fit_seconds, fit_weights, fit_note (null when none).
void add_fit_json(nlohmann::json& j, const FitPlacement& f);

/// A sparse MoE block whose routed experts run on the GPU (lutb::cuda::GpuMoeLayer) while the rest
/// of the CPU block stays on the CPU, through its model::MoeBlockParts (router logits x . gate^T in
/// FP32; the shared experts): out = float(moe_forward(bf16(x), route_gpu(logits))) + shared(x). That
/// is the CPU block's own forward (spec section 4: BF16 tokens in, BF16 routed sum out; for LUT-B the
/// kernel's MXFP8 step of bf16(x) is the emulation's), so the two differ only by FP32 summation order
/// inside moe_forward, which can move a BF16 output by one unit where the FP32 sum lies next to a
/// rounding boundary (tests/cuda/cli_gpu_test.cpp bounds it).
/// The routing runs on the GPU (route_softmax_topk / route_deepseek) when the rule has a kernel,
/// else on the CPU with the block's own rule (routing_note() says which and why).
/// Experts: LUT-B held by the fast CPU kernel (LutbCpuExperts; uploaded packed, lane-major) with
/// MXFP8 activations, or BF16 (quant none, BF16 activations; moe_forward_bf16, needs H % 64 == 0 and
/// I % 64 == 0). Other settings throw UsageError (check_gpu_options); experts held otherwise,
/// std::invalid_argument naming what has no GPU path.
class GpuMoeBlock final : public model::MoeBlock {
 public:
  GpuMoeBlock(std::unique_ptr<model::MoeBlock> cpu, const model::MoeOptions& opt);
  ~GpuMoeBlock() override;
  void forward(const float* x, std::int64_t T, float* out) override;
  const model::MoeBlockParts* parts() const override;
  /// The CPU block it was built from (the CPU emulation, for comparisons).
  model::MoeBlock& cpu();
  /// "gpu (softmax top-k)", "gpu (DeepSeek grouped sigmoid)" or "cpu (<why the GPU has no kernel>)".
  const std::string& routing_note() const;
  /// Median GPU time (ms, CUDA events) of the routed-expert forward of the last forward() call.
  double time_routed_ms(int reps);
  std::size_t device_bytes() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// The default job's GPU section (src/cli/default_job.cpp), run only when cuda_unavailable_reason()
/// is empty. Its lines are printed by the caller; `json` collects the figures.
struct DefaultJobGpu {
  std::vector<std::string> lines;
  nlohmann::json json = nlohmann::json::object();
};
/// GPU fit of one layer: quantize_gpu of w13 [E, 2I, H] and w2 [E, H, I] (BF16 bits) with `fitter`,
/// compared byte for byte with the CPU fit of the same layer (cpu13 / cpu2: what `lutb quantize` wrote),
/// timed (wall time of the two calls, host-device copies included). A fitter without a GPU kernel
/// adds a line saying so.
void default_job_gpu_fit(DefaultJobGpu& r, const std::vector<std::uint16_t>& w13, const std::vector<std::uint16_t>& w2,
                         const moe::MoeConfig& mc, const LutbTensor& cpu13, const LutbTensor& cpu2,
                         const std::string& fitter);
/// The fused GPU forward of the layer (cpu: the LUT-B emulation that produced cpu_out from x and the
/// routing) at T = 1 (token 0) and T = tokens: median time of moe_forward over `reps` (CUDA events)
/// and the relative L2 error of the GPU output against cpu_out's rows.
void default_job_gpu_forward(DefaultJobGpu& r, const moe::Experts& cpu, const std::uint16_t* x, std::int64_t tokens,
                             const moe::TopK& topk, const float* cpu_out, int reps);

/// A MoeFactory building GpuMoeBlocks from `cpu`'s blocks (eval --device cuda).
model::MoeFactory gpu_factory(model::MoeFactory cpu, const model::MoeOptions& opt);

}  // namespace lutb::cli
