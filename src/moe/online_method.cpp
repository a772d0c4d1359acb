// The online LUT-B MoE method (spec section 6; the seed's LutBOnlineMoEMethod), the native support
// probe and the native-layout experts.
#include <stdexcept>
#include <utility>

#include <fmt/format.h>

#include "lutb/fit.hpp"
#include "lutb/moe.hpp"
#include "lutb/sm107_layout.hpp"
#include "moe/moe_internal.hpp"

namespace lutb::moe {

// ---------------------------------------------------------------------------
// NativeSupport
// ---------------------------------------------------------------------------
NativeSupport NativeSupport::decide(bool built_with_sm107, int device_major, int device_minor) {
  if (!built_with_sm107) return {false, "built without sm_107 support"};
  if (device_major < 0) return {false, "no CUDA device with compute capability 10.7 (no CUDA device found)"};
  if (device_major != 10 || device_minor != 7)
    return {false, fmt::format("no CUDA device with compute capability 10.7 (device has {}.{})", device_major,
                               device_minor)};
  return {true, ""};
}

NativeSupport NativeSupport::probe() {
#if defined(LUTB_WITH_SM107)
#error "sm_107 kernels are not part of this project: CUDA 13.0 cannot target compute capability 10.7"
#else
  // No sm_107 code in this build: the device does not matter (and the CPU library does not link
  // the CUDA runtime to ask).
  return decide(/*built_with_sm107=*/false, -1, 0);
#endif
}

// ---------------------------------------------------------------------------
// Sm107Experts
// ---------------------------------------------------------------------------
struct Sm107Experts::Impl {
  sm107::Sm107Tensor w13, w2;
};

Sm107Experts::Sm107Experts(MoeConfig cfg, const LutbTensor& w13, const LutbTensor& w2) : Experts(std::move(cfg)) {
  detail::check_lutb_pair(cfg_, w13, w2, "Sm107Experts");
  auto impl = std::make_shared<Impl>();
  impl->w13 = sm107::to_sm107(w13.view());
  impl->w2 = sm107::to_sm107(w2.view());
  impl_ = std::move(impl);
}

std::size_t Sm107Experts::weight_bytes() const { return impl_->w13.bytes() + impl_->w2.bytes(); }

void Sm107Experts::apply_f32(const HiddenStates& x, const TopK& topk, float* out) const {
  // Functional model of the native kernel: read the native layout back (sm107_layout.hpp A1..A6)
  // and run the spec-4 emulation on it. On sm_107 hardware the tcgen05 launch replaces this.
  LutbCpuExperts emu(cfg_, sm107::from_sm107(impl_->w13), sm107::from_sm107(impl_->w2), ActivationFormat::MXFP8);
  emu.apply_f32(x, topk, out);
}

// ---------------------------------------------------------------------------
// RoutedExpertsLayer
// ---------------------------------------------------------------------------
RoutedExpertsLayer::RoutedExpertsLayer(MoeConfig cfg, DType dtype) : config(std::move(cfg)), weight_dtype(dtype) {
  config.finalize();
  if (dtype != DType::BF16 && dtype != DType::F16)
    throw std::invalid_argument(
        fmt::format("RoutedExpertsLayer: weight dtype {} is not BF16 or F16", dtype_name(dtype)));
  const std::size_t E = static_cast<std::size_t>(config.local_experts());
  const std::size_t H = static_cast<std::size_t>(config.hidden_size);
  const std::size_t I = static_cast<std::size_t>(config.intermediate_size_per_partition);
  w13_weight.assign(E * 2 * I * H, 0);
  w2_weight.assign(E * H * I, 0);
}

std::uint16_t* RoutedExpertsLayer::w13_expert(int local) {
  return w13_weight.data() + static_cast<std::size_t>(local) * 2 * config.intermediate_size_per_partition * config.hidden_size;
}
std::uint16_t* RoutedExpertsLayer::w2_expert(int local) {
  return w2_weight.data() + static_cast<std::size_t>(local) * config.hidden_size * config.intermediate_size_per_partition;
}

// ---------------------------------------------------------------------------
// LutBOnlineMoEMethod
// ---------------------------------------------------------------------------
LutBOnlineMoEMethod::LutBOnlineMoEMethod(MoeConfig cfg, OnlineOptions options)
    : cfg_(std::move(cfg)), opt_(std::move(options)) {
  // The seed's checks, in its order and with its messages.
  if (cfg_.has_bias) throw std::invalid_argument("LUT-B online MoE quantization does not support bias.");
  if (cfg_.moe_backend != "auto" && cfg_.moe_backend != "emulation")
    throw std::invalid_argument(fmt::format(
        "moe_backend='{}' is not supported for LUT-B MoE; expected 'auto' or 'emulation'.", cfg_.moe_backend));
  cfg_.finalize();
  if (!opt_.fit.fitter.empty() && !opt_.fit_function) check_fitter_name(opt_.fit.fitter);
  if (opt_.fit.threads < 0)
    throw std::invalid_argument(fmt::format("FitOptions::threads {}: must be >= 0 (0 = all cores)", opt_.fit.threads));

  // Backend selection (the seed: LUT_B_SM107_TILE_K = LUT_B_SM107_TILE_N = 128).
  const bool native_shape = cfg_.hidden_size % 128 == 0 && cfg_.intermediate_size_per_partition % 128 == 0;
  const NativeSupport support = opt_.native_support ? *opt_.native_support : NativeSupport::probe();
  if (cfg_.moe_backend == "emulation") {
    backend_ = Backend::Emulation;
  } else if (support.supported && native_shape) {
    backend_ = Backend::Native;
  } else {
    backend_ = Backend::Emulation;
    reason_ = support.supported ? "hidden and intermediate sizes must be multiples of 128" : support.reason;
    // Worded for a CPU user, who has nothing to fix: not as a fault ("falls back").
    log_once(LogLevel::Info, "LUT-B MoE: CPU emulation of Rubin's LUT-B numerics (native sm_107 path not used: " +
                                 reason_ + ")");
  }
}

const Experts& LutBOnlineMoEMethod::kernel() const {
  if (!kernel_) throw std::logic_error("LutBOnlineMoEMethod: process_weights_after_loading has not run");
  return *kernel_;
}

namespace {
void check_layer(const MoeConfig& m, const RoutedExpertsLayer& layer) {
  const MoeConfig& l = layer.config;
  if (l.global_experts != m.global_experts || l.top_k != m.top_k || l.hidden_size != m.hidden_size ||
      l.intermediate_size_per_partition != m.intermediate_size_per_partition ||
      l.hidden_unpadded() != m.hidden_unpadded() || l.intermediate_unpadded() != m.intermediate_unpadded() ||
      l.expert_map.local_to_global != m.expert_map.local_to_global)
    throw std::invalid_argument("LutBOnlineMoEMethod: the layer's MoE config differs from the method's");
}

void release(std::vector<std::uint16_t>& v) {
  std::vector<std::uint16_t>().swap(v);  // frees the storage (clear() alone keeps the capacity)
}

void zero_padding(const MoeConfig& c, RoutedExpertsLayer& layer) {
  const std::int64_t E = c.local_experts(), H = c.hidden_size, I = c.intermediate_size_per_partition;
  const std::int64_t Hu = c.hidden_unpadded(), Iu = c.intermediate_unpadded();
  if (Hu == H && Iu == I) return;
  for (std::int64_t e = 0; e < E; ++e) {
    std::uint16_t* w13 = layer.w13_weight.data() + e * 2 * I * H;
    for (std::int64_t n = 0; n < 2 * I; ++n) {
      const bool pad_row = (n % I) >= Iu;  // both halves: gate rows Iu..I-1, up rows I+Iu..2I-1
      for (std::int64_t k = 0; k < H; ++k)
        if (pad_row || k >= Hu) w13[n * H + k] = 0;
    }
    std::uint16_t* w2 = layer.w2_weight.data() + e * H * I;
    for (std::int64_t n = 0; n < H; ++n)
      for (std::int64_t k = 0; k < I; ++k)
        if (n >= Hu || k >= Iu) w2[n * I + k] = 0;
  }
}
}  // namespace

QuantizeReport LutBOnlineMoEMethod::process_weights_after_loading(RoutedExpertsLayer& layer) {
  QuantizeReport rep;
  if (layer.already_processed) return rep;
  check_layer(cfg_, layer);
  if (layer.weight_dtype != DType::BF16 && layer.weight_dtype != DType::F16)
    throw std::invalid_argument(fmt::format("LutBOnlineMoEMethod: weight dtype {} is not BF16 or F16",
                                            dtype_name(layer.weight_dtype)));
  const LutbShape s13 = cfg_.w13_shape(), s2 = cfg_.w2_shape();
  const std::size_t n13 = static_cast<std::size_t>(s13.experts * s13.rows * s13.cols);
  const std::size_t n2 = static_cast<std::size_t>(s2.experts * s2.rows * s2.cols);
  if (layer.w13_weight.size() != n13 || layer.w2_weight.size() != n2)
    throw std::invalid_argument(fmt::format(
        "LutBOnlineMoEMethod: source weights hold w13_weight {} / w2_weight {} elements, expected {} / {}",
        layer.w13_weight.size(), layer.w2_weight.size(), n13, n2));

  zero_padding(cfg_, layer);
  const FitFunction fit = opt_.fit_function ? opt_.fit_function
                                            : FitFunction([](const void* src, DType t, const LutbShape& s, LutbTensor& out,
                                                             const FitOptions& o, const std::string& name) {
                                                return quantize(src, t, s, out, o, name);
                                              });
  LutbTensor w13, w2;
  rep.w13 = fit(layer.w13_weight.data(), layer.weight_dtype, s13, w13, opt_.fit, "w13_weight");
  rep.w2 = fit(layer.w2_weight.data(), layer.weight_dtype, s2, w2, opt_.fit, "w2_weight");
  rep.source_bytes = (layer.w13_weight.size() + layer.w2_weight.size()) * sizeof(std::uint16_t);
  build_kernel(layer, std::move(w13), std::move(w2));
  rep.quantized_bytes = kernel_->weight_bytes();
  return rep;
}

void LutBOnlineMoEMethod::load_packed(RoutedExpertsLayer& layer, LutbTensor w13, LutbTensor w2) {
  if (layer.already_processed)
    throw std::logic_error("LutBOnlineMoEMethod::load_packed: the layer's weights were already processed");
  check_layer(cfg_, layer);
  build_kernel(layer, std::move(w13), std::move(w2));
}

void LutBOnlineMoEMethod::build_kernel(RoutedExpertsLayer& layer, LutbTensor w13, LutbTensor w2) {
  std::shared_ptr<const Experts> k;
  if (backend_ == Backend::Native)
    k = std::make_shared<Sm107Experts>(cfg_, w13, w2);  // converted to the native tile layout
  else
    k = make_lutb_experts(cfg_, std::move(w13), std::move(w2), opt_.emulation, opt_.activations);
  // Only now that the kernel exists: release the source weights (memory really returns).
  release(layer.w13_weight);
  release(layer.w2_weight);
  kernel_ = std::move(k);
  layer.already_processed = true;
}

}  // namespace lutb::moe
