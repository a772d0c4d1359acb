// Checkpoint: loading a Hugging Face MoE checkpoint's layers (spec section 7) and stored LUT-B
// experts (spec section 2.2).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <sstream>

#include <fmt/core.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "io/checkpoint_internal.hpp"
#include "lutb/checkpoint.hpp"

namespace lutb {

// ---------------------------------------------------------------------------
// DenseStack
// ---------------------------------------------------------------------------
std::vector<float> DenseStack::to_float() const {
  const std::int64_t n = numel();
  std::vector<float> out(static_cast<std::size_t>(n));
  detail::convert_to_f32(data.data(), dtype, out.data(), n);
  return out;
}

std::vector<std::uint16_t> DenseStack::to_bf16() const {
  const std::int64_t n = numel();
  std::vector<std::uint16_t> out(static_cast<std::size_t>(n));
  if (dtype == DType::BF16) {
    std::memcpy(out.data(), data.data(), out.size() * 2);
    return out;
  }
  std::vector<float> f = to_float();
  for (std::int64_t i = 0; i < n; ++i) out[i] = bf16_from_float(f[i]);
  return out;
}

namespace detail {

void convert_to_f32(const void* src, DType t, float* out, std::int64_t n) {
  switch (t) {
    case DType::F32: std::memcpy(out, src, static_cast<std::size_t>(n) * 4); return;
    // memcpy loads: a safetensors tensor's data need not be aligned to its element size.
    case DType::BF16: {
      const auto* p = static_cast<const unsigned char*>(src);
      for (std::int64_t i = 0; i < n; ++i) {
        std::uint16_t v;
        std::memcpy(&v, p + 2 * i, 2);
        out[i] = bf16_to_float(v);
      }
      return;
    }
    case DType::F16: {
      const auto* p = static_cast<const unsigned char*>(src);
      for (std::int64_t i = 0; i < n; ++i) {
        std::uint16_t v;
        std::memcpy(&v, p + 2 * i, 2);
        out[i] = fp16_to_float(v);
      }
      return;
    }
    case DType::F64: {
      const auto* p = static_cast<const unsigned char*>(src);
      for (std::int64_t i = 0; i < n; ++i) {
        double v;
        std::memcpy(&v, p + 8 * i, 8);
        out[i] = static_cast<float>(v);
      }
      return;
    }
    default: throw std::invalid_argument(fmt::format("convert_to_f32: {} is not a float dtype", dtype_name(t)));
  }
}

std::string shape_str(const std::vector<std::int64_t>& s) { return fmt::format("[{}]", fmt::join(s, ", ")); }

}  // namespace detail

// ---------------------------------------------------------------------------
// Checkpoint
// ---------------------------------------------------------------------------
Checkpoint::Checkpoint(const std::filesystem::path& dir) : dir_(dir) {
  if (!std::filesystem::is_directory(dir))
    throw CheckpointError(fmt::format("{}: not a checkpoint directory (does not exist or is not a directory)", dir.string()));
  config_ = load_model_config(dir);
  st_ = std::make_unique<SafetensorsCollection>(SafetensorsCollection::open_dir(dir));
  quant_ = parse_lutb_quant_config(config_.raw, (dir / "config.json").string());
}
Checkpoint::~Checkpoint() = default;
Checkpoint::Checkpoint(Checkpoint&&) noexcept = default;
Checkpoint& Checkpoint::operator=(Checkpoint&&) noexcept = default;

bool Checkpoint::contains(const std::string& name) const { return st_->contains(name); }

const TensorView& Checkpoint::tensor(const std::string& name) const {
  if (!st_->contains(name))
    throw CheckpointError(fmt::format("checkpoint {}: tensor {} not found{}", dir_.string(), name, st_->absent_note(name)));
  return st_->get(name);
}

namespace {

// A float weight's dtype and shape, from its header only. `file` is the safetensors file that holds
// the tensor (in a sharded checkpoint the folder alone would leave the user to find the shard); `origin` says where `expected` comes from (e.g. " from DIR/config.json (hidden_size
// 256, expert width 128)"), or is empty.
void check_float_header(const std::string& file, const TensorView& v, const std::vector<std::int64_t>& expected,
                        const std::string& origin) {
  if (!dtype_is_float_source(v.dtype))
    throw CheckpointError(fmt::format("{}: tensor {} has dtype {}, expected a float weight (BF16, F16, F32 or F64)",
                                      file, v.name, dtype_name(v.dtype)));
  if (v.shape != expected)
    throw CheckpointError(fmt::format("{}: tensor {} has shape {}, expected {}{}", file, v.name,
                                      detail::shape_str(v.shape), detail::shape_str(expected), origin));
}

// Copies a float tensor into dst (of dtype `to`), checking its shape. F64 sources are narrowed to F32.
void copy_float(const std::string& file, const TensorView& v, const std::vector<std::int64_t>& expected,
                const std::string& origin, DType to, std::uint8_t* dst) {
  check_float_header(file, v, expected, origin);
  if (v.dtype == to) {
    std::memcpy(dst, v.data, v.nbytes);
    detail::release_pages(v.data, v.nbytes);  // the copy is what we keep; drop the mapped pages from RSS
    return;
  }
  if (to != DType::F32)
    throw CheckpointError(fmt::format("{}: tensor {} has dtype {} but the other experts of the stack are {}", file,
                                      v.name, dtype_name(v.dtype), dtype_name(to)));
  detail::convert_to_f32(v.data, v.dtype, reinterpret_cast<float*>(dst), v.numel());
  // An F64 value beyond the FP32 range would become +-Inf when narrowed: refused with its real
  // magnitude and place.
  if (v.dtype == DType::F64) {
    const auto* f = reinterpret_cast<const float*>(dst);
    for (std::int64_t i = 0; i < v.numel(); ++i) {
      if (std::isfinite(f[i])) continue;
      double x;
      std::memcpy(&x, v.data + 8 * i, 8);
      if (!std::isfinite(x)) continue;  // NaN / Inf stored as such
      std::vector<std::int64_t> at(v.shape.size());
      std::int64_t r = i;
      for (std::size_t d = v.shape.size(); d-- > 0;) {
        at[d] = r % v.shape[d];
        r /= v.shape[d];
      }
      throw CheckpointError(fmt::format("{}: tensor {} (F64) holds {} at {}, beyond the FP32 range lutb computes in "
                                        "(largest magnitude about 3.4e+38)",
                                        file, v.name, x, detail::shape_str(at)));
    }
  }
  detail::release_pages(v.data, v.nbytes);
}

DType stack_dtype(DType t) { return t == DType::F64 ? DType::F32 : t; }

}  // namespace

DenseStack Checkpoint::dense(const std::string& name) const {
  const TensorView& v = tensor(name);
  DenseStack d;
  d.dtype = stack_dtype(v.dtype);
  if (v.shape.size() == 1) {
    d.rows = 1;
    d.cols = v.shape[0];
  } else if (v.shape.size() == 2) {
    d.rows = v.shape[0];
    d.cols = v.shape[1];
  } else {
    throw CheckpointError(fmt::format("{}: tensor {} has shape {}, expected 1-D or 2-D", file_of(name), name,
                                      detail::shape_str(v.shape)));
  }
  d.data.resize(static_cast<std::size_t>(d.numel()) * dtype_size(d.dtype));
  copy_float(file_of(v.name), v, v.shape, "", d.dtype, d.data.data());
  return d;
}

std::string Checkpoint::find_stacked(std::int64_t layer, bool gate_up, const char* suffix) const {
  std::vector<std::string> cands = {gate_up ? stacked_gate_up_name(config_, layer) : stacked_down_name(config_, layer)};
  if (config_.family == ModelFamily::mixtral)  // transformers 5 renames block_sparse_moe to mlp
    cands.push_back(fmt::format("model.layers.{}.mlp.experts.{}", layer, gate_up ? "gate_up_proj" : "down_proj"));
  for (const auto& c : cands)
    if (st_->contains(c + suffix)) return c;
  return {};
}

void Checkpoint::check_moe_layer(std::int64_t layer) const {
  if (!config_.is_moe_layer(layer))
    throw CheckpointError(fmt::format("checkpoint {}: layer {} is not a MoE layer of this {} model (MoE layers: {})",
                                      dir_.string(), layer, config_.model_type, fmt::join(config_.moe_layers(), ", ")));
}

bool Checkpoint::experts_stacked(std::int64_t layer) const {
  return !find_stacked(layer, true, "").empty() || !find_stacked(layer, true, "_packed").empty();
}

bool Checkpoint::experts_lutb(std::int64_t layer) const {
  if (!find_stacked(layer, true, "_packed").empty()) return true;
  return st_->contains(lutb_names(expert_weight_name(config_, layer, 0, Proj::gate)).packed);
}

ExpertsSource Checkpoint::experts_source(std::int64_t L) const {
  check_moe_layer(L);
  if (experts_lutb(L))
    throw CheckpointError(fmt::format("checkpoint {}: layer {}'s experts are stored as LUT-B (*_packed tensors), "
                                      "not as BF16 weights{}",
                                      dir_.string(), L,
                                      quant_ ? std::string()
                                             : "; its config.json has no LUT-B quantization_config, so it is not "
                                               "read as a LUT-B checkpoint (one `lutb quantize` wrote has it)"));
  const std::int64_t E = config_.num_experts, H = config_.hidden_size, I = config_.moe_intermediate_size;
  ExpertsSource s;
  s.w13.experts = s.w2.experts = E;
  s.w13.rows = 2 * I;
  s.w13.cols = H;
  s.w2.rows = H;
  s.w2.cols = I;
  const std::string gu = find_stacked(L, true, "");
  if (!gu.empty()) {
    const std::string dn = find_stacked(L, false, "");
    if (dn.empty())
      throw CheckpointError(fmt::format("checkpoint {}: tensor {} not found (stacked experts: {} is present)",
                                        dir_.string(), stacked_down_name(config_, L), gu));
    const TensorView& a = tensor(gu);
    const TensorView& b = tensor(dn);
    // gate_up and down of different float dtypes: both read as F32 (see the per-expert case below).
    const DType dt = a.dtype == b.dtype ? stack_dtype(a.dtype) : DType::F32;
    check_float_header(file_of(a.name), a, {E, 2 * I, H}, expected_from_config());  // before the stacks are
    check_float_header(file_of(b.name), b, {E, H, I}, expected_from_config());      // allocated at those sizes
    s.w13.dtype = dt;
    s.w2.dtype = dt;
    s.w13.data.resize(static_cast<std::size_t>(s.w13.numel()) * dtype_size(s.w13.dtype));
    s.w2.data.resize(static_cast<std::size_t>(s.w2.numel()) * dtype_size(s.w2.dtype));
    copy_float(file_of(a.name), a, {E, 2 * I, H}, expected_from_config(), s.w13.dtype, s.w13.data.data());
    copy_float(file_of(b.name), b, {E, H, I}, expected_from_config(), s.w2.dtype, s.w2.data.data());
    return s;
  }
  // A routed expert that config.json implies but the checkpoint lacks: the message names the config, the
  // layer and the files searched, as lutb quantize's does (not only "checkpoint DIR: tensor X
  // not found").
  const auto expert_tensor = [&](const std::string& n) -> const TensorView& {
    if (!st_->contains(n))
      throw CheckpointError(fmt::format("checkpoint {}: layer {} is a MoE layer of {}, which declares {} routed "
                                        "experts, but its routed-expert tensor {} is missing{}",
                                        dir_.string(), L, (dir_ / "config.json").string(), config_.num_experts, n,
                                        st_->absent_note(n)));
    return st_->get(n);
  };
  const TensorView& first = expert_tensor(expert_weight_name(config_, L, 0, Proj::gate));
  // Experts of different float dtypes (one F32 expert among BF16 ones) are stacked as F32, each
  // converted exactly: lutb quantize takes such a layer (it fits each tensor on its own) and eval
  // refused it ("F32 but the other experts of the stack are BF16"). Only the headers are read here.
  DType dt = stack_dtype(first.dtype);
  for (std::int64_t e = 0; e < E && dt != DType::F32; ++e)
    for (Proj p : {Proj::gate, Proj::up, Proj::down}) {
      const std::string n = expert_weight_name(config_, L, e, p);
      if (st_->contains(n) && dtype_is_float_source(st_->get(n).dtype) && stack_dtype(st_->get(n).dtype) != dt)
        dt = DType::F32;
    }
  // Every expert's dtype and shape before the stacks are allocated at config.json's sizes: a corrupt
  // moe_intermediate_size (2e9) is a shape error naming the tensor, not "out of memory".
  const std::string origin = expected_from_config();
  for (std::int64_t e = 0; e < E; ++e)
    for (Proj p : {Proj::gate, Proj::up, Proj::down}) {
      const std::string n = expert_weight_name(config_, L, e, p);
      check_float_header(file_of(n), expert_tensor(n), p == Proj::down ? std::vector<std::int64_t>{H, I}
                                                                 : std::vector<std::int64_t>{I, H}, origin);
    }
  const std::size_t es = dtype_size(dt);
  s.w13.dtype = s.w2.dtype = dt;
  s.w13.data.resize(static_cast<std::size_t>(s.w13.numel()) * es);
  s.w2.data.resize(static_cast<std::size_t>(s.w2.numel()) * es);
  for (std::int64_t e = 0; e < E; ++e) {
    std::uint8_t* w13 = s.w13.data.data() + static_cast<std::size_t>(e * 2 * I * H) * es;
    const std::string g = expert_weight_name(config_, L, e, Proj::gate), u = expert_weight_name(config_, L, e, Proj::up),
                      d = expert_weight_name(config_, L, e, Proj::down);
    copy_float(file_of(g), tensor(g), {I, H}, origin, dt, w13);
    copy_float(file_of(u), tensor(u), {I, H}, origin, dt, w13 + static_cast<std::size_t>(I * H) * es);
    copy_float(file_of(d), tensor(d), {H, I}, origin, dt, s.w2.data.data() + static_cast<std::size_t>(e * H * I) * es);
  }
  return s;
}

std::string Checkpoint::file_of(const std::string& name) const {
  return st_->contains(name) ? st_->file_of(name).path().string() : dir_.string();
}

std::string Checkpoint::expected_from_config() const {
  return fmt::format(" from {} (hidden_size {}, expert width {}, {} experts)", (dir_ / "config.json").string(),
                     config_.hidden_size, config_.moe_intermediate_size, config_.num_experts);
}

// Errors name the file that holds the tensor, the tensor as stored, the layer (and expert for
// per-expert tensors) and the reason (they named the internal stacks "w13" / "w2" and the
// checkpoint folder only).
void Checkpoint::read_lutb(const std::string& weight_name, const LutbShape& one, LutbTensor& out,
                           std::int64_t tile_offset, std::int64_t layer, std::int64_t expert, bool headers_only) const {
  const LutbNames n = lutb_names(weight_name);
  const std::string who = expert >= 0 ? fmt::format("layer {}, expert {}", layer, expert) : fmt::format("layer {}", layer);
  auto get = [&](const std::string& name, const char* why) -> const TensorView& {
    if (!st_->contains(name))
      throw CheckpointError(
          fmt::format("checkpoint {}: tensor {} ({}) not found{}{}", dir_.string(), name, who, why, st_->absent_note(name)));
    return st_->get(name);
  };
  const TensorView& p = get(n.packed, "");
  const TensorView& c = get(n.codebook, fmt::format(" ({} is present)", n.packed).c_str());
  std::vector<std::int64_t> grid;
  if (one.stacked) grid.push_back(one.experts);
  grid.push_back(one.tiles_n());
  grid.push_back(one.tiles_k());
  auto with = [&](std::int64_t last) {
    auto g = grid;
    g.push_back(last);
    return g;
  };
  auto check = [&](const TensorView& v, DType dt, const std::vector<std::int64_t>& shape) {
    if (v.dtype != dt)
      throw CheckpointError(fmt::format("{}: tensor {} ({}) has dtype {}, expected {} (spec 2.2)", file_of(v.name),
                                        v.name, who, dtype_name(v.dtype), dtype_name(dt)));
    if (v.shape != shape)
      throw CheckpointError(fmt::format("{}: tensor {} ({}) has shape {}, expected {} for logical shape [{}{}, {}] "
                                        "(spec 2.2)",
                                        file_of(v.name), v.name, who, detail::shape_str(v.shape), detail::shape_str(shape),
                                        one.stacked ? fmt::format("{}, ", one.experts) : "", one.rows, one.cols));
  };
  // quantization_config.logical_shapes must agree with the shape config.json gives the tensor; a
  // contradicting entry is refused.
  if (quant_) {
    const auto ls = quant_->logical_shapes.find(weight_name);
    const std::vector<std::int64_t> logical =
        one.stacked ? std::vector<std::int64_t>{one.experts, one.rows, one.cols} : std::vector<std::int64_t>{one.rows, one.cols};
    if (ls != quant_->logical_shapes.end() && ls->second != logical)
      throw CheckpointError(fmt::format("checkpoint {}: config.json key 'quantization_config.logical_shapes.{}' ({}) is "
                                        "{}, but hidden_size {} and the expert width {} give {}",
                                        dir_.string(), weight_name, who, detail::shape_str(ls->second),
                                        config_.hidden_size, config_.moe_intermediate_size, detail::shape_str(logical)));
  }
  check(p, DType::U8, with(kPackedBytes));
  check(c, DType::F8_E4M3, with(kCodebookSize));
  if (headers_only) {
    if (st_->contains(n.scale)) check(st_->get(n.scale), DType::U8, grid);
    return;
  }
  const std::int64_t tiles = one.tiles();
  // The tile (in the stored tensor's own grid) named by a data error.
  auto tile_at = [&](std::int64_t t) {
    const std::int64_t tn = one.tiles_n(), tk = one.tiles_k(), per = tn * tk;
    const std::int64_t e = t / per, r = t % per;
    return one.stacked ? fmt::format("tile [{}, {}, {}] (expert {}, tile row {}, tile column {})", e, r / tk, r % tk, e,
                                     r / tk, r % tk)
                       : fmt::format("tile [{}, {}] (tile row {}, tile column {})", r / tk, r % tk, r / tk, r % tk);
  };
  const auto* cb = static_cast<const std::uint8_t*>(c.data);
  for (std::int64_t t = 0; t < tiles; ++t)
    for (int j = 0; j < kCodebookSize; ++j)
      if (e4m3_is_nan(cb[t * kCodebookSize + j]))
        throw FormatError(fmt::format("{}: tensor {} ({}): {} has a NaN codebook entry (entry {}, byte 0x{:02X}); "
                                      "E4M3 codebook bytes 0x7F and 0xFF are NaN and invalid in LUT-B (spec 2)",
                                      file_of(c.name), c.name, who, tile_at(t), j, cb[t * kCodebookSize + j]));
  std::memcpy(out.packed.data() + tile_offset * kPackedBytes, p.data, static_cast<std::size_t>(tiles) * kPackedBytes);
  std::memcpy(out.codebook.data() + tile_offset * kCodebookSize, c.data, static_cast<std::size_t>(tiles) * kCodebookSize);
  detail::release_pages(p.data, p.nbytes);
  detail::release_pages(c.data, c.nbytes);
  if (st_->contains(n.scale)) {
    const TensorView& s = st_->get(n.scale);
    check(s, DType::U8, grid);
    const auto* sc = static_cast<const std::uint8_t*>(s.data);
    for (std::int64_t t = 0; t < tiles; ++t)
      if (sc[t] == kUE8M0NaN)
        throw FormatError(fmt::format("{}: tensor {} ({}): {} has scale byte 255, which is UE8M0 NaN and invalid in "
                                      "LUT-B (spec 2)",
                                      file_of(s.name), s.name, who, tile_at(t)));
    // A scale byte above 246 is valid UE8M0, but with a large codebook entry the weight e4m3 * 2^(s
    // - 127) is beyond FP32 (>= 2^128): it decoded to Inf and `lutb eval` reported a NaN loss
    // naming no tensor. Such a tile is refused here, by name.
    for (std::int64_t t = 0; t < tiles; ++t) {
      if (sc[t] <= 246) continue;  // spec 2: every value of scale bytes up to 246 is exact in FP32
      for (int j = 0; j < kCodebookSize; ++j) {
        const std::uint8_t b = cb[t * kCodebookSize + j];
        const double w = std::ldexp(std::fabs(static_cast<double>(e4m3_to_float(b))), sc[t] - 127);
        if (w >= 0x1p128)
          throw FormatError(fmt::format(
              "{}: tensor {} ({}): {} has scale byte {}, and its codebook entry {} (byte 0x{:02X}, {}) times 2^{} "
              "is beyond the FP32 range: the weights would be infinite (fitters write scale bytes 3..246, spec 2); "
              "the checkpoint is corrupt",
              file_of(s.name), s.name, who, tile_at(t), sc[t], j, b, e4m3_to_float(b), sc[t] - 127));
      }
    }
    std::memcpy(out.scale.data() + tile_offset, s.data, static_cast<std::size_t>(tiles));
  } else if (quant_ && quant_->compressed_tensors) {
    std::memset(out.scale.data() + tile_offset, kUE8M0One, static_cast<std::size_t>(tiles));  // spec 2.2
  } else {
    throw CheckpointError(fmt::format("{}: tensor {} ({}) not found, but {} is there: only compressed-tensors \"lut-b\" "
                                      "checkpoints may omit weight_scale",
                                      file_of(n.packed), n.scale, who, n.packed));
  }
}

// Per-expert LUT-B gate and up cannot be joined into the [E, 2I, H] stack the MoE kernels run when I
// % 8 != 0: each is padded to whole 8-row tiles on its own (the error named a library function, not
// the file, the tensor or what to do).
[[noreturn]] void Checkpoint::throw_unstackable(std::int64_t L) const {
  const std::int64_t I = config_.moe_intermediate_size;
  const std::string g = lutb_names(expert_weight_name(config_, L, 0, Proj::gate)).packed;
  const std::string u = lutb_names(expert_weight_name(config_, L, 0, Proj::up)).packed;
  throw FormatError(fmt::format(
      "{}: tensor {} (layer {}): this checkpoint stores each expert's gate and up projections as separate LUT-B "
      "tensors ({}, ...), and the expert width moe_intermediate_size {} of {} is not a multiple of 8, so each is "
      "padded to {} rows of whole 8-row tiles; lutb runs an expert's gate and up as one [2I, H] = [{}, {}] LUT-B "
      "matrix, whose tiles would straddle gate and up, so the stored tiles cannot be used. Quantise the BF16 "
      "checkpoint with stacked experts instead (gate_up_proj [E, 2I, H]; `lutb synth --stacked` writes that layout), "
      "or run the BF16 checkpoint with --quant lutb, which fits the stacked layout when it loads",
      file_of(g), g, L, u, I, (dir_ / "config.json").string(), (I + 7) / 8 * 8, 2 * I, config_.hidden_size));
}

void Checkpoint::check_lutb_headers(std::int64_t L, Proj p) const {
  const std::int64_t E = config_.num_experts, H = config_.hidden_size, I = config_.moe_intermediate_size;
  const bool down = p == Proj::down;
  LutbTensor none;
  const std::string st = find_stacked(L, !down, "_packed");
  if (st.empty() && down && !find_stacked(L, true, "_packed").empty()) return;  // lutb_projection names what is missing
  if (!st.empty()) {
    read_lutb(st, LutbShape{E, down ? H : 2 * I, down ? I : H, true}, none, 0, L, -1, true);
    return;
  }
  const LutbShape one{1, down ? H : I, down ? I : H, false};
  for (std::int64_t e = 0; e < E; ++e)
    for (Proj q : down ? std::vector<Proj>{Proj::down} : std::vector<Proj>{Proj::gate, Proj::up})
      read_lutb(expert_weight_name(config_, L, e, q), one, none, 0, L, e, true);
}

LutbTensor Checkpoint::lutb_projection(std::int64_t L, Proj p) const {
  check_moe_layer(L);
  if (!experts_lutb(L))
    throw CheckpointError(fmt::format("checkpoint {}: layer {}'s experts are not stored as LUT-B", dir_.string(), L));
  const std::int64_t E = config_.num_experts, H = config_.hidden_size, I = config_.moe_intermediate_size;
  const bool down = p == Proj::down;
  LutbShape shape{E, down ? H : I, down ? I : H, true};
  // The stored shapes before anything is allocated at config.json's sizes: a corrupt
  // moe_intermediate_size (2e9) is a shape error naming the tensor, not "out of memory".
  check_lutb_headers(L, down ? Proj::down : Proj::gate);
  LutbTensor out(shape);
  const std::string gu = find_stacked(L, true, "_packed");
  if (!gu.empty()) {
    if (down) {
      const std::string dn = find_stacked(L, false, "_packed");
      if (dn.empty())
        throw CheckpointError(fmt::format("{}: tensor {} (layer {}) not found, but {} is there", dir_.string(),
                                          lutb_names(stacked_down_name(config_, L)).packed, L,
                                          lutb_names(gu).packed));
      read_lutb(dn, shape, out, 0, L);
      return out;
    }
    if (I % kTileRows != 0)
      throw FormatError(fmt::format("{}: tensor {} (layer {}) is a stacked LUT-B gate_up tensor and the expert width "
                                    "moe_intermediate_size {} is not a multiple of 8: its tiles straddle gate and up, "
                                    "so the {} projection cannot be read on its own (the whole gate_up stack can)",
                                    file_of(lutb_names(gu).packed), lutb_names(gu).packed, L, I, proj_name(p)));
    ExpertsLutb all;
    all.w13 = LutbTensor(LutbShape{E, 2 * I, H, true});
    read_lutb(gu, all.w13.shape, all.w13, 0, L);
    const std::int64_t per = shape.tiles_per_expert(), per13 = all.w13.shape.tiles_per_expert();
    const std::int64_t off = p == Proj::up ? per : 0;
    for (std::int64_t e = 0; e < E; ++e) {
      std::memcpy(out.packed.data() + e * per * kPackedBytes, all.w13.packed.data() + (e * per13 + off) * kPackedBytes,
                  static_cast<std::size_t>(per) * kPackedBytes);
      std::memcpy(out.codebook.data() + e * per * kCodebookSize,
                  all.w13.codebook.data() + (e * per13 + off) * kCodebookSize, static_cast<std::size_t>(per) * kCodebookSize);
      std::memcpy(out.scale.data() + e * per, all.w13.scale.data() + e * per13 + off, static_cast<std::size_t>(per));
    }
    return out;
  }
  LutbShape one{1, shape.rows, shape.cols, false};
  for (std::int64_t e = 0; e < E; ++e) read_lutb(expert_weight_name(config_, L, e, p), one, out, e * one.tiles(), L, e);
  return out;
}

std::string Checkpoint::expert_location(std::int64_t L, bool w13, std::int64_t expert, std::int64_t row,
                                        std::int64_t col) const {
  const std::int64_t I = config_.moe_intermediate_size;
  std::string name = find_stacked(L, w13, "");
  if (name.empty()) {
    const Proj p = !w13 ? Proj::down : (row < I ? Proj::gate : Proj::up);
    if (p == Proj::up) row -= I;
    name = expert_weight_name(config_, L, expert, p);
  }
  return fmt::format("{}: tensor {} (layer {}, expert {}), row {} col {}", file_of(name), name, L, expert, row, col);
}

namespace {
// The first source weight of a fused expert stack the LUT-B fit refuses (NaN, +-Inf, or a magnitude
// whose tile would need a scale byte above 246, spec 2), located with Checkpoint::expert_location,
// as std::invalid_argument. The fit reported "quantize: tensor model.layers.0.mlp w13, expert 1,
// tile (8, 0): NaN at row 69 col 7": a fused stack, no file.
void check_fittable(const Checkpoint& ck, std::int64_t L, bool w13, const DenseStack& s) {
  const std::int64_t n = s.numel(), per = s.rows * s.cols;
  std::vector<float> v(static_cast<std::size_t>(std::min<std::int64_t>(n, per)));
  for (std::int64_t e = 0; e * per < n; ++e) {
    detail::convert_to_f32(s.data.data() + static_cast<std::size_t>(e * per) * dtype_size(s.dtype), s.dtype, v.data(),
                           per);
    for (std::int64_t i = 0; i < per; ++i) {
      const float x = v[static_cast<std::size_t>(i)];
      std::string what;
      if (!std::isfinite(x))
        what = std::string(std::isnan(x) ? "NaN" : (x > 0 ? "+Inf" : "-Inf")) +
               "; a non-finite weight cannot be quantised to LUT-B (spec 2.1)";
      else if (x != 0.0f && ue8m0_rceil(std::fabs(x)) > 246)
        what = fmt::format("magnitude {} needs a scale byte above 246 (spec section 2); it cannot be quantised to LUT-B",
                           std::fabs(x));
      if (!what.empty())
        throw std::invalid_argument(fmt::format("{}: {}", ck.expert_location(L, w13, e, i / s.cols, i % s.cols), what));
    }
  }
}
}  // namespace

ExpertsLutb Checkpoint::lutb_experts(std::int64_t L, const FitOptions& fit, FitStats* stats) const {
  check_moe_layer(L);
  const std::int64_t E = config_.num_experts, H = config_.hidden_size, I = config_.moe_intermediate_size;
  ExpertsLutb r;
  if (!experts_lutb(L)) {
    if (fit.threads < 0)
      throw std::invalid_argument(fmt::format("FitOptions::threads {}: must be >= 0 (0 = all cores)", fit.threads));
    // The online method: fit the source stacks as w13 [E, 2I, H] and w2 [E, H, I].
    ExpertsSource s = experts_source(L);
    check_fittable(*this, L, true, s.w13);
    check_fittable(*this, L, false, s.w2);
    const std::string base = moe_prefix(config_, L);
    FitStats a = quantize(s.w13.ptr(), s.w13.dtype, LutbShape{E, 2 * I, H, true}, r.w13, fit, base + " w13");
    s.w13.data = {};
    FitStats b = quantize(s.w2.ptr(), s.w2.dtype, LutbShape{E, H, I, true}, r.w2, fit, base + " w2");
    if (stats) {
      *stats += a;
      *stats += b;
    }
    return r;
  }
  const std::string gu = find_stacked(L, true, "_packed");
  // The stored shapes before anything is allocated at config.json's sizes (see lutb_projection).
  if (gu.empty() && I % kTileRows != 0) throw_unstackable(L);
  check_lutb_headers(L, Proj::gate);
  check_lutb_headers(L, Proj::down);
  if (!gu.empty()) {
    r.w13 = LutbTensor(LutbShape{E, 2 * I, H, true});
    read_lutb(gu, r.w13.shape, r.w13, 0, L);
  } else {
    if (I % kTileRows != 0) throw_unstackable(L);
    r.w13 = LutbTensor(LutbShape{E, 2 * I, H, true});
    LutbShape one{1, I, H, false};
    for (std::int64_t e = 0; e < E; ++e) {
      const std::int64_t base = e * r.w13.shape.tiles_per_expert();
      read_lutb(expert_weight_name(config_, L, e, Proj::gate), one, r.w13, base, L, e);
      read_lutb(expert_weight_name(config_, L, e, Proj::up), one, r.w13, base + one.tiles(), L, e);
    }
  }
  r.w2 = lutb_projection(L, Proj::down);
  return r;
}

RouterWeights Checkpoint::router(std::int64_t L) const {
  check_moe_layer(L);
  RouterWeights r;
  std::string name = router_weight_name(config_, L);
  if (!st_->contains(name) && config_.family == ModelFamily::mixtral) {
    const std::string alt = fmt::format("model.layers.{}.mlp.gate.weight", L);
    if (st_->contains(alt)) name = alt;
  }
  r.weight = dense(name);
  if (r.weight.rows != config_.num_experts || r.weight.cols != config_.hidden_size)
    throw CheckpointError(fmt::format("{}: tensor {} has shape [{}, {}], expected [{}, {}] from {} (num_experts {}, "
                                      "hidden_size {})",
                                      file_of(name), name, r.weight.rows, r.weight.cols, config_.num_experts,
                                      config_.hidden_size, (dir_ / "config.json").string(), config_.num_experts,
                                      config_.hidden_size));
  const std::string bname = router_bias_name(config_, L);
  if (!bname.empty()) {
    if (st_->contains(bname)) {
      DenseStack b = dense(bname);
      if (b.numel() != config_.num_experts)
        throw CheckpointError(fmt::format("{}: tensor {} has {} elements, expected {} (num_experts of {})",
                                          file_of(bname), bname, b.numel(), config_.num_experts,
                                          (dir_ / "config.json").string()));
      r.bias = b.to_float();
    } else if (config_.topk_method == "noaux_tc") {
      throw CheckpointError(fmt::format("checkpoint {}: tensor {} not found (DeepSeek-V3 noaux_tc routing needs the "
                                        "correction bias)",
                                        dir_.string(), bname));
    }
  }
  return r;
}

std::optional<SharedExpert> Checkpoint::shared_expert(std::int64_t L) const {
  check_moe_layer(L);
  if (config_.shared_expert_intermediate_size <= 0) return std::nullopt;
  const std::int64_t H = config_.hidden_size, S = config_.shared_expert_intermediate_size;
  const bool qwen2 = config_.family == ModelFamily::qwen2_moe;
  const std::string base = moe_prefix(config_, L) + (qwen2 ? ".shared_expert" : ".shared_experts");
  SharedExpert s;
  auto get = [&](const char* proj, std::int64_t rows, std::int64_t cols) {
    const std::string n = fmt::format("{}.{}.weight", base, proj);
    DenseStack d = dense(n);
    if (d.rows != rows || d.cols != cols)
      throw CheckpointError(fmt::format("{}: tensor {} has shape [{}, {}], expected [{}, {}] from {} (hidden_size {}, "
                                        "shared expert width {})",
                                        file_of(n), n, d.rows, d.cols, rows, cols, (dir_ / "config.json").string(), H, S));
    return d;
  };
  s.gate = get("gate_proj", S, H);
  s.up = get("up_proj", S, H);
  s.down = get("down_proj", H, S);
  if (qwen2) {
    const std::string g = moe_prefix(config_, L) + ".shared_expert_gate.weight";
    DenseStack d = dense(g);
    if (d.numel() != H)
      throw CheckpointError(fmt::format("{}: tensor {} has {} elements, expected [1, {}] (hidden_size of {})",
                                        file_of(g), g, d.numel(), H, (dir_ / "config.json").string()));
    s.output_gate = std::move(d);
  }
  return s;
}

}  // namespace lutb
