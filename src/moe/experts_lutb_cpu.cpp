// LUT-B emulation, fast CPU kernel: packed weights decoded inside the GEMM (cpu_kernels.inc), tokens
// grouped by expert, OpenMP over (expert, row block) jobs (moe_internal.hpp run_grouped).
#include "moe/cpu_kernels.hpp"
#include "moe/moe_internal.hpp"

namespace lutb::moe {

LutbCpuExperts::LutbCpuExperts(MoeConfig cfg, LutbTensor w13, LutbTensor w2, ActivationFormat act, CpuIsa isa)
    : Experts(std::move(cfg)), w13_(std::move(w13)), w2_(std::move(w2)), act_(act), isa_(detail::runnable_isa(isa)) {
  detail::check_lutb_pair(cfg_, w13_, w2_, "LutbCpuExperts");
}

std::string LutbCpuExperts::name() const { return std::string("lutb-cpu/") + cpu_isa_name(isa_); }

void LutbCpuExperts::apply_f32(const HiddenStates& x, const TopK& topk, float* out) const {
  const LutbShape s13 = w13_.shape, s2 = w2_.shape;
  detail::run_grouped(
      cfg_, x, topk, act_,
      [&](int which, int e, std::int64_t n0, std::int64_t n1, const float* const* a, int ntok, float* const* c) {
        const LutbTensor& w = which == 0 ? w13_ : w2_;
        const LutbShape& s = which == 0 ? s13 : s2;
        const std::int64_t t0 = static_cast<std::int64_t>(e) * s.tiles_per_expert();
        detail::lutb_gemm(isa_, w.packed.data() + t0 * kPackedBytes, w.codebook.data() + t0 * kCodebookSize,
                          w.scale.data() + t0, s.tiles_k(), s.rows, n0, n1, a, ntok, c);
      },
      /*job_weights=*/std::int64_t{1} << 16, out);
}

}  // namespace lutb::moe
