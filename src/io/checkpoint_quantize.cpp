// Writing LUT-B checkpoints by streaming quantisation (spec section 2.2).
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <string_view>

#include <fmt/core.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "io/config_json.hpp"
#include "io/checkpoint_internal.hpp"
#include "io/tensor_names.hpp"
#include "lutb/checkpoint.hpp"
#include "lutb/numerics.hpp"

namespace lutb {

namespace fs = std::filesystem;

namespace {

constexpr std::size_t kCopyChunk = 32u << 20;  // bytes copied (and released) at a time
// A copied file at least this large is named in a warning: a tokenizer.json (the largest file a
// checkpoint normally carries besides its weights) is a few MB to a few tens of MB.
constexpr std::uintmax_t kLargeCopy = 100u << 20;

// Removes a temporary path on scope exit unless released.
struct TempGuard {
  fs::path path;
  bool armed = true;
  ~TempGuard() {
    if (!armed) return;
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

// A write error of the output's temporary (a full disk: "OUT.tmp.PID/model.safetensors.tmp.PID: write
// failed: No space left on device") names a temporary that is removed as the error propagates, so it
// is reported against the output, with what became of OUT. Errors of the writer (their text starts
// with the temporary's path) are reworded; others pass. The same for the files written beside the
// shards (config.json, the index, the copied tokenizer and other files). Returns "" for an error that
// is not about the temporary.
std::string write_error_message(const std::string& m, const fs::path& tmp, const fs::path& out) {
  if (m.rfind(tmp.string(), 0) != 0) return {};
  return fmt::format("{}: writing the output failed ({}); the partial output was removed and {}", out.string(), m,
                     detail::target_left_clause(out));
}

// An error raised mid-run, after the temporary output exists (a NaN in an expert, an unreadable input
// file, an invalid index), must say what became of OUT; with --force over an existing OUT "nothing
// written" would read as if OUT were gone. The message ends with what became of OUT:
// a trailing "; nothing written" stays while OUT does not exist and becomes "; OUT is as it was" when
// it does; a message without either gets "; the partial output was removed and " +
// target_left_clause(OUT). One that already says it (write_error_message, an interruption) is left as
// it is.
std::string with_target_left(std::string m, const fs::path& out) {
  if (m.find(" is as it was") != std::string::npos || m.find("nothing was created at ") != std::string::npos) return m;
  constexpr std::string_view tail = "; nothing written";
  std::error_code ec;
  const bool exists = fs::exists(fs::symlink_status(out, ec));
  if (m.size() >= tail.size() && m.compare(m.size() - tail.size(), tail.size(), tail) == 0) {
    if (exists) m.replace(m.size() - tail.size(), tail.size(), "; " + detail::target_left_clause(out));
    return m;
  }
  return m + "; the partial output was removed and " + detail::target_left_clause(out);
}

[[noreturn]] void throw_write_error(const SafetensorsError& e, const fs::path& tmp, const fs::path& out) {
  const std::string w = write_error_message(e.what(), tmp, out);
  if (w.empty()) throw e;
  throw CheckpointError(w);
}

bool same_path(const fs::path& a, const fs::path& b) {
  std::error_code ec;
  if (fs::exists(a, ec) && fs::exists(b, ec)) return fs::equivalent(a, b, ec);
  // weakly_canonical returns an empty path where it fails (a name too long, a loop of links): two
  // such paths are not the same one.
  const fs::path ca = fs::weakly_canonical(a, ec);
  if (ec || ca.empty()) return a.lexically_normal() == b.lexically_normal();
  const fs::path cb = fs::weakly_canonical(b, ec);
  if (ec || cb.empty()) return a.lexically_normal() == b.lexically_normal();
  return ca == cb;
}

struct Planned {
  std::string name;
  bool quantize = false;
  LutbShape shape;  // when quantize
};

std::vector<std::int64_t> grid_shape(const LutbShape& s, std::int64_t last) {
  std::vector<std::int64_t> g;
  if (s.stacked) g.push_back(s.experts);
  g.push_back(s.tiles_n());
  g.push_back(s.tiles_k());
  if (last > 0) g.push_back(last);
  return g;
}

LutbShape shape_of(const TensorView& v) {
  if (v.shape.size() == 2) return LutbShape{1, v.shape[0], v.shape[1], false};
  return LutbShape{v.shape[0], v.shape[1], v.shape[2], true};
}

std::vector<std::int64_t> logical_dims(const LutbShape& s) {
  if (s.stacked) return {s.experts, s.rows, s.cols};
  return {s.rows, s.cols};
}

bool quantizable(const TensorView& v) {
  return dtype_is_float_source(v.dtype) && (v.shape.size() == 2 || v.shape.size() == 3) && v.numel() > 0;
}

// Declares the output tensors of one plan entry.
void declare(SafetensorsWriter& w, const Planned& p, const TensorView& v, QuantizeSummary& s) {
  if (!p.quantize) {
    w.declare(p.name, v.dtype, v.shape);
    s.output_bytes += v.nbytes;
    return;
  }
  const LutbNames n = lutb_names(p.name);
  w.declare(n.packed, DType::U8, grid_shape(p.shape, kPackedBytes));
  w.declare(n.codebook, DType::F8_E4M3, grid_shape(p.shape, kCodebookSize));
  w.declare(n.scale, DType::U8, grid_shape(p.shape, 0));
  const std::uint64_t b = static_cast<std::uint64_t>(p.shape.tiles()) * (kPackedBytes + kCodebookSize + 1);
  s.output_bytes += b;
}

// An F64 weight whose magnitude is beyond the FP32 range (the fitters read F64 as F32, where it would
// become +-Inf and be reported as "+Inf at row R col C") is reported with its real magnitude, like a tile of
// too large FP32 values. Checked before narrowing; `file` names the source file. Any such value is
// reported, wherever it is: its tile needs a scale byte above 246.
void check_f64_range(const fs::path& file, const Planned& p, const TensorView& v) {
  const auto* b = static_cast<const unsigned char*>(v.data);
  const std::int64_t n = v.numel();
  for (std::int64_t i = 0; i < n; ++i) {
    double x;
    std::memcpy(&x, b + 8 * i, 8);
    if (!std::isfinite(x) || std::isfinite(static_cast<float>(x))) continue;
    const std::int64_t per = p.shape.rows * p.shape.cols, e = i / per, row = (i % per) / p.shape.cols,
                       col = i % p.shape.cols;
    char buf[32];
    const auto r = std::to_chars(buf, buf + sizeof(buf), std::fabs(x));
    throw std::invalid_argument(fmt::format(
        "{}: tensor {}{}, tile ({}, {}): magnitude {} at row {} col {} needs a scale byte above 246 (spec section 2; "
        "it is beyond the FP32 range, the fitters read F64 weights as F32); nothing written",
        file.string(), p.name, p.shape.stacked ? fmt::format(", expert {}", e) : "", row / kTileRows, col / kTileCols,
        std::string_view(buf, static_cast<std::size_t>(r.ptr - buf)), row, col));
  }
}

// After the fit refused a tile whose magnitude needs a scale byte above 246: the message as the F64
// one above, with the row and column of the tile's largest magnitude (the fit's message named only
// the tile; src/fit and the GPU fitters share that wording, so the place is added here). Scans the
// tiles in the fit's order; "" when none is found.
std::string scale_overflow_at(const fs::path& file, const Planned& p, const TensorView& v) {
  const std::int64_t rows = p.shape.rows, cols = p.shape.cols, per = rows * cols;
  const std::int64_t tn_n = (rows + kTileRows - 1) / kTileRows, tk_n = (cols + kTileCols - 1) / kTileCols;
  const std::size_t es = dtype_size(v.dtype);
  float x[kTileCols];
  for (std::int64_t e = 0; e < p.shape.experts; ++e)
    for (std::int64_t tn = 0; tn < tn_n; ++tn)
      for (std::int64_t tk = 0; tk < tk_n; ++tk) {
        float amax = 0.0f;
        std::int64_t ar = -1, ac = -1;
        for (std::int64_t r = tn * kTileRows; r < std::min(rows, (tn + 1) * kTileRows); ++r) {
          const std::int64_t c0 = tk * kTileCols, nc = std::min(cols, c0 + kTileCols) - c0;
          detail::convert_to_f32(v.data + static_cast<std::size_t>(e * per + r * cols + c0) * es, v.dtype, x, nc);
          for (std::int64_t c = 0; c < nc; ++c)
            if (std::fabs(x[c]) > amax) {
              amax = std::fabs(x[c]);
              ar = r;
              ac = c0 + c;
            }
        }
        if (ar < 0 || !std::isfinite(amax) || ue8m0_rceil(amax) <= 246) continue;
        char buf[32];
        const auto res = std::to_chars(buf, buf + sizeof(buf), amax);
        return fmt::format("{}: tensor {}{}, tile ({}, {}): magnitude {} at row {} col {} needs a scale byte above 246 "
                           "(spec section 2); nothing written",
                           file.string(), p.name, p.shape.stacked ? fmt::format(", expert {}", e) : "", tn, tk,
                           std::string_view(buf, static_cast<std::size_t>(res.ptr - buf)), ar, ac);
      }
  return {};
}

// Writes the output tensors of one plan entry (quantising when planned), then releases the source pages.
// Polls `stop` (see QuantizeOptions::interrupt) before the tensor, between copy chunks and, through
// the fitter, before every tile. `file` is the source file, for the messages.
// The first NaN / Inf among elements [first, first + count) of float tensor `v` (of a dtype
// dtype_is_float_source accepts), refused naming the file, the tensor and the element: a copied tensor
// the model reads (a norm, the router, ...) otherwise made lutb eval fail after the whole run.
void check_finite(const fs::path& file, const TensorView& v, std::int64_t first, std::int64_t count) {
  const auto* b = v.data;
  for (std::int64_t i = first; i < first + count; ++i) {
    bool bad = false;
    switch (v.dtype) {
      case DType::BF16:
      case DType::F16: {
        std::uint16_t x;
        std::memcpy(&x, b + 2 * i, 2);
        bad = v.dtype == DType::BF16 ? (x & 0x7f80u) == 0x7f80u : (x & 0x7c00u) == 0x7c00u;
        break;
      }
      case DType::F32: {
        float x;
        std::memcpy(&x, b + 4 * i, 4);
        bad = !std::isfinite(x);
        break;
      }
      case DType::F64: {
        double x;
        std::memcpy(&x, b + 8 * i, 8);
        bad = !std::isfinite(x);
        break;
      }
      default: return;
    }
    if (!bad) continue;
    std::vector<std::int64_t> at(v.shape.size());
    std::int64_t r = i;
    for (std::size_t d = v.shape.size(); d-- > 0;) {
      at[d] = r % v.shape[d];
      r /= v.shape[d];
    }
    double x = 0;
    if (v.dtype == DType::F64) std::memcpy(&x, b + 8 * i, 8);
    else if (v.dtype == DType::F32) { float f; std::memcpy(&f, b + 4 * i, 4); x = f; }
    else {
      std::uint16_t h;
      std::memcpy(&h, b + 2 * i, 2);
      x = v.dtype == DType::BF16 ? bf16_to_float(h) : fp16_to_float(h);
    }
    throw std::invalid_argument(fmt::format("{}: tensor {} ({}) holds {} at {}: lutb eval and lutb moe cannot compute "
                                            "with a non-finite weight; nothing written",
                                            file.string(), v.name, dtype_name(v.dtype),
                                            std::isnan(x) ? "NaN" : (x > 0 ? "+Inf" : "-Inf"), detail::shape_str(at)));
  }
}

void emit(SafetensorsWriter& w, const Planned& p, const TensorView& v, const FitOptions& fit,
          const QuantizeOptions::FitFunction& fit_function, QuantizeSummary& s, detail::Progress& prog,
          const InterruptFlag* stop, const fs::path& target, const fs::path& file, bool scan_finite) {
  detail::check_interrupt(stop, target);
  if (!p.quantize) {
    const std::size_t es = dtype_size(v.dtype);
    scan_finite = scan_finite && dtype_is_float_source(v.dtype) && es > 0;
    for (std::size_t off = 0; off < v.nbytes; off += kCopyChunk) {
      if (off > 0) detail::check_interrupt(stop, target);
      const std::size_t n = std::min(kCopyChunk, v.nbytes - off);
      if (scan_finite)  // kCopyChunk is a multiple of every element size
        check_finite(file, v, static_cast<std::int64_t>(off / es), static_cast<std::int64_t>(n / es));
      w.write(v.data + off, n);
      detail::release_pages(v.data + off, n);
      prog.advance(n);
    }
    if (v.nbytes == 0) w.write(v.data, 0);
    ++s.tensors_copied;
    return;
  }
  LutbTensor out;
  FitStats st;
  // The fit itself polls the flag before every tile (a large tensor takes seconds to minutes).
  FitOptions fo = fit;
  if (!fo.interrupt) fo.interrupt = stop;
  if (v.dtype == DType::F64) check_f64_range(file, p, v);
  try {
    if (v.dtype == DType::F64) {  // fitters take F32/BF16/F16: narrow F64 first
      std::vector<float> f(static_cast<std::size_t>(v.numel()));
      detail::convert_to_f32(v.data, v.dtype, f.data(), v.numel());
      st = fit_function ? fit_function(f.data(), DType::F32, p.shape, out, fo, p.name)
                        : quantize(f.data(), DType::F32, p.shape, out, fo, p.name);
    } else {
      st = fit_function ? fit_function(v.data, v.dtype, p.shape, out, fo, p.name)
                        : quantize(v.data, v.dtype, p.shape, out, fo, p.name);
    }
  } catch (const Interrupted& e) {
    // The caller's guard removes the temporary output as this unwinds.
    throw Interrupted(e.signal,
                      fmt::format("{}: interrupted by signal {} ({}) while fitting tensor {} after {} of {} tiles; the "
                                  "partial output was removed and {}",
                                  target.string(), e.signal, strsignal(e.signal), p.name, e.tiles_done, e.tiles_total,
                                  detail::target_left_clause(target)),
                      e.tiles_done, e.tiles_total);
  } catch (const std::invalid_argument& e) {
    // A data error of the fit (NaN / Inf / a magnitude needing a scale byte above 246, spec 2.1):
    // "quantize: tensor T, expert E, tile (..): NaN at row R col C". The message named no file; the
    // caller's guard removes the temporary output as this unwinds.
    std::string m = e.what();
    if (m.rfind("quantize: ", 0) == 0) m.erase(0, 10);
    if (m.find("needs a scale byte above 246") != std::string::npos && m.find(" at row ") == std::string::npos)
      if (std::string at = scale_overflow_at(file, p, v); !at.empty()) throw std::invalid_argument(at);
    throw std::invalid_argument(fmt::format("{}: {}; nothing written", file.string(), m));
  }
  detail::release_pages(v.data, v.nbytes);
  w.write(out.packed.data(), out.packed.size());
  w.write(out.codebook.data(), out.codebook.size());
  w.write(out.scale.data(), out.scale.size());
  s.stats += st;
  if (std::string w = low_sqnr_warning(fmt::format("{}: tensor {}", file.string(), p.name), st.sse, st.sum_sq,
                                       p.shape.experts * p.shape.rows * p.shape.cols, s.fitter);
      !w.empty())
    s.warnings.push_back(std::move(w));
  ++s.tensors_quantized;
  s.weights += p.shape.experts * p.shape.rows * p.shape.cols;
  s.bytes_before += v.nbytes;
  s.bytes_after += out.bytes();
  prog.advance(v.nbytes);
}

void write_text(const fs::path& path, const std::string& text) { detail::write_text_file(path, text); }

// A decimal index of a tensor name (the regexes match \d+ only); -1 when it does not fit 63 bits
// (std::stoll threw a bare "stoll" out_of_range for "model.layers.99999999999999999999...").
std::int64_t index_of(const std::string& digits) {
  std::int64_t v = -1;
  const auto r = std::from_chars(digits.data(), digits.data() + digits.size(), v);
  return r.ec == std::errc() && r.ptr == digits.data() + digits.size() ? v : -1;
}

// Layer index of "model.layers.L...." (-1 when the name has none).
std::int64_t layer_of(const std::string& name) {
  static const std::regex re(R"(^model\.layers\.(\d+)\.)");
  std::smatch m;
  return std::regex_search(name, m, re) ? index_of(m[1].str()) : -1;
}

// Files that hold the model's weights in another well-known form than this checkpoint's shards:
// PyTorch (pytorch_model*.bin and its index), Meta / Mistral originals (consolidated*.pth, .pt,
// .safetensors), TensorFlow (tf_model*.h5), Flax (flax_model*.msgpack) and their index files, GGUF.
// Other files, including other safetensors files (val_tokens.safetensors, captured activations), are
// copied, except training state (training_state_file below).
bool other_weight_file(const std::string& name) {
  auto starts = [&](std::string_view pre) { return name.rfind(pre, 0) == 0; };
  auto ends = [&](std::string_view suf) {
    return name.size() >= suf.size() && name.compare(name.size() - suf.size(), suf.size(), suf) == 0;
  };
  if (ends(".gguf")) return true;
  if (starts("pytorch_model") && (ends(".bin") || ends(".bin.index.json"))) return true;
  if (starts("consolidated") && (ends(".pth") || ends(".pt") || ends(".safetensors"))) return true;
  if (starts("tf_model") && (ends(".h5") || ends(".h5.index.json"))) return true;
  return starts("flax_model") && (ends(".msgpack") || ends(".msgpack.index.json"));
}

// The training state a checkpoint saved mid-training carries beside its weights (`lutb quantize`
// copied a Trainer's optimizer.pt, twice the size of the weights, into the LUT-B output):
//  - transformers' Trainer (trainer.py, _save_optimizer_and_scheduler / _save_rng_state):
//    optimizer.pt, scheduler.pt, scaler.pt, rng_state.pth / rng_state_N.pth, training_args.bin
//    (a pickle);
//  - Accelerate's save_state: optimizer*.bin, scheduler*.bin, random_states_N.pkl, scaler.pt.
// trainer_state.json (the training log, a few KB of text) is still copied.
bool training_state_file(const std::string& name) {
  auto starts = [&](std::string_view pre) { return name.rfind(pre, 0) == 0; };
  auto ends = [&](std::string_view suf) {
    return name.size() >= suf.size() && name.compare(name.size() - suf.size(), suf.size(), suf) == 0;
  };
  if (name == "training_args.bin" || name == "scaler.pt") return true;
  if ((starts("optimizer") || starts("scheduler")) && (ends(".pt") || ends(".bin"))) return true;
  if (starts("rng_state") && ends(".pth")) return true;
  return starts("random_states_") && ends(".pkl");
}

// The reference losses of the source weights (reference_eval.json of the model folders, spec section
// 8: transformers' held-out loss of the BF16 weights). Copied into the LUT-B output, it read as the
// reference of weights it does not describe: left out and listed. The held-out tokens
// (val_tokens.safetensors) and the captured BF16 activations are still copied: lutb eval and lutb
// moe read them from the output folder, as inputs to compare against.
bool source_reference_file(const std::string& name) { return name == "reference_eval.json"; }

// DeepSpeed's ZeRO checkpoint folders global_stepN/ (optimizer and model states of every rank,
// several times the weights' size), written beside the weights by the Trainer with DeepSpeed.
bool training_state_folder(const std::string& name) {
  if (name.rfind("global_step", 0) != 0 || name.size() == 11) return false;
  return std::all_of(name.begin() + 11, name.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// The folders the copy of quantize_checkpoint leaves out (besides symlinked ones): download caches
// (.cache/, .huggingface/), version control (.git/) and DeepSpeed's training state.
bool skipped_folder(const std::string& name) {
  return name == ".cache" || name == ".huggingface" || name == ".git" || training_state_folder(name);
}

// The bytes of the files the copy of quantize_checkpoint will take from in_dir (its rules: not
// config.json, the index, the shards, weights in another form, training state, skipped folders, or
// anything that is not a regular file), for the free-space check before anything is written. Each
// of them is also opened for reading once, and a folder that cannot be listed is refused: an
// unreadable tokenizer.json must be found before the fit (hours on a real model), not by the copy
// step after it (docs/cli.md: everything is checked before anything is written). Throws
// CheckpointError naming the input file and the reason.
std::uint64_t bytes_to_copy(const fs::path& in_dir, const std::set<std::string>& shards) {
  std::uint64_t n = 0;
  std::error_code ec;
  fs::path listing = in_dir;  // the folder the iterator reads next, for the message
  auto it = fs::recursive_directory_iterator(in_dir, ec);
  for (; !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
    listing = it->path();
    const fs::path rel = it->path().lexically_relative(in_dir);
    std::error_code e2;
    if (it->is_directory(e2)) {
      if (it->is_symlink(e2) || skipped_folder(rel.filename().string())) it.disable_recursion_pending();
      continue;
    }
    if (!it->is_regular_file(e2)) continue;
    const std::string fname = rel.string(), base = rel.filename().string();
    if (fname == "config.json" || fname == "model.safetensors.index.json" || shards.count(fname) ||
        other_weight_file(base) || training_state_file(base) || source_reference_file(fname))
      continue;
    const int fd = ::open(it->path().c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      const int err = errno;
      throw CheckpointError(fmt::format("{}: cannot open it for reading: {}; lutb quantize copies it into the output "
                                        "(every file of the input folder besides the weights is copied): make it "
                                        "readable, or move it out of the input folder; nothing written",
                                        it->path().string(), std::strerror(err)));
    }
    ::close(fd);
    const std::uintmax_t sz = it->file_size(e2);
    if (!e2) n += sz;
  }
  if (ec)
    throw CheckpointError(fmt::format("{}: cannot list the input folder's files under it: {}; lutb quantize copies "
                                      "every file of the input folder besides the weights into the output; nothing "
                                      "written",
                                      listing.string(), ec.message()));
  return n;
}

// The routed-expert tensors found for one MoE layer.
struct LayerExperts {
  std::set<std::pair<std::int64_t, int>> per_expert;  // (expert, Proj)
  bool gate_up = false, down = false;                  // stacked tensors
};

Proj proj_of(const std::string& p) {
  if (p == "gate_proj" || p == "w1") return Proj::gate;
  if (p == "up_proj" || p == "w3") return Proj::up;
  return Proj::down;
}

// Every MoE layer config.json declares must have all its routed experts, and every MoE layer with
// any must have them all (a checkpoint missing an expert, or declaring more experts or layers than
// it stores, would become a LUT-B checkpoint that lutb eval refuses). Throws CheckpointError
// naming the first missing tensor.
void check_experts_complete(const fs::path& in_dir, const ModelConfig& cfg, const SafetensorsCollection& st,
                            const std::map<std::int64_t, LayerExperts>& found) {
  const fs::path config = in_dir / "config.json";
  auto missing = [&](std::int64_t L, const std::string& name, const char* what) {
    // absent_note: "; SHARD holds it, but INDEX's weight_map does not list it (add it there)".
    throw CheckpointError(fmt::format("checkpoint {}: layer {} is a MoE layer of {} ({} experts, {} layers) but {} is "
                                      "missing{}{}; nothing written",
                                      in_dir.string(), L, config.string(), cfg.num_experts, cfg.num_hidden_layers, name,
                                      what, st.absent_note(name)));
  };
  // Declared MoE layers without any routed-expert tensor (stops at the first: the layer count is
  // bounded by the config parser).
  for (std::int64_t L = 0; L < cfg.num_hidden_layers; ++L)
    if (cfg.is_moe_layer(L) && !found.count(L))
      missing(L, expert_weight_name(cfg, L, 0, Proj::gate), " (no routed-expert tensor of this layer was found)");
  for (const auto& [L, x] : found) {
    if (x.gate_up || x.down) {
      if (!x.gate_up) missing(L, stacked_gate_up_name(cfg, L), " (its stacked down_proj is present)");
      if (!x.down) missing(L, stacked_down_name(cfg, L), " (its stacked gate_up_proj is present)");
      continue;
    }
    for (std::int64_t e = 0; e < cfg.num_experts; ++e)
      for (Proj p : {Proj::gate, Proj::up, Proj::down})
        if (!x.per_expert.count({e, static_cast<int>(p)})) missing(L, expert_weight_name(cfg, L, e, p), "");
  }
}

void check_threads(const FitOptions& f) {
  if (f.threads < 0)
    throw std::invalid_argument(fmt::format("quantize: FitOptions::threads {}: must be >= 0 (0 = all cores); nothing "
                                            "written",
                                            f.threads));
}

std::string resolved_fitter(const FitOptions& f) {
  if (f.fitter.empty()) return default_fitter();
  check_fitter_name(f.fitter);
  return f.fitter;
}

}  // namespace

namespace detail {

std::string skipped_file_reason(const std::string& rel) {
  const bool folder = !rel.empty() && rel.back() == '/';
  const std::string path = folder ? rel.substr(0, rel.size() - 1) : rel;
  const std::string base = fs::path(path).filename().string();
  if (folder) {
    if (base == ".git") return "version control";
    if (base == ".cache" || base == ".huggingface") return "download cache";
    if (training_state_folder(base)) return "training state";
    return "a symbolic link to a folder, not followed";
  }
  if (other_weight_file(base)) return "the weights in another format";
  if (training_state_file(base)) return "training state";
  if (source_reference_file(path)) return "the source weights' reference losses, spec section 8";
  return "not a regular file: see the warning";
}

}  // namespace detail

namespace {

// ---------------------------------------------------------------------------
// quantize_checkpoint, step by step: check the output, plan (with one checker per validated
// thing), check the model and the free space, write the shards (fit), write the index and the
// config, copy the other files, commit. Every refusal comes before the temporary output exists.
// ---------------------------------------------------------------------------

// Step 1: the options and the output, before the input is read.
void check_output(const fs::path& in_dir, const fs::path& out_dir, const QuantizeOptions& opt) {
  check_threads(opt.fit);
  if (out_dir.empty()) throw CheckpointError("quantize: no output directory given");
  detail::check_directory_output_name(out_dir, "quantize");
  if (same_path(in_dir, out_dir))
    throw CheckpointError(fmt::format("{}: the output directory is the input checkpoint", out_dir.string()));
  detail::check_output_location(in_dir, out_dir);
  detail::check_replaceable(out_dir, /*want_directory=*/true, opt.force);
  if (fs::exists(out_dir) && !opt.force)
    throw CheckpointError(fmt::format("{}: output directory exists (use --force to replace it); nothing written",
                                      out_dir.string()));
}

// A LUT-B checkpoint (by its quantization_config) is not quantised again.
void check_not_lutb(const Checkpoint& ck, const fs::path& in_dir) {
  if (ck.is_lutb())
    throw CheckpointError(fmt::format("{}: the checkpoint is already LUT-B ({} has a LUT-B quantization_config); "
                                      "nothing to do: to quantise again (e.g. with another --fitter), start from the "
                                      "original BF16 checkpoint; nothing written",
                                      in_dir.string(), (in_dir / "config.json").string()));
}

// What is written: per shard, its tensors in file order, each quantised or copied.
struct Plan {
  std::vector<std::vector<Planned>> shards;                        // parallel to the input's files
  std::uint64_t total_bytes = 0;                                   // input bytes, for the progress bar
  std::map<std::string, std::vector<std::int64_t>> logical_shapes;  // padded tensors
  std::map<std::int64_t, LayerExperts> found;                      // routed experts per MoE layer
};

// What the planning checkers need to know about the checkpoint.
struct PlanContext {
  const Checkpoint& ck;
  const ModelConfig& cfg;
  const fs::path& in_dir;
  const std::regex& pattern;
  std::int64_t extra_layers;  // DeepSeek-V3's num_nextn_predict_layers, stored after the decoder layers
  std::int64_t layer_end;     // layers config.json declares: num_hidden_layers + extra_layers
};

// Layers config.json declares: num_hidden_layers decoder layers, plus DeepSeek-V3's multi-token
// prediction layers (num_nextn_predict_layers, stored after them as model.layers.N...).
std::int64_t extra_declared_layers(const ModelConfig& cfg) {
  if (const auto it = cfg.raw.find("num_nextn_predict_layers");
      it != cfg.raw.end() && it->is_number_integer() && it->get<std::int64_t>() > 0 && it->get<std::int64_t>() < 1024)
    return it->get<std::int64_t>();
  return 0;
}

// A tensor of a layer config.json does not declare would be quantised, or copied, as if it belonged
// to the model.
void check_declared_layer(const PlanContext& c, const fs::path& file, const std::string& name) {
  if (const std::int64_t L = layer_of(name); L >= c.layer_end)
    throw CheckpointError(fmt::format("{}: tensor {} belongs to layer {}, but {} declares num_hidden_layers {}{} "
                                      "(layers 0..{}): the checkpoint has layers the config does not; nothing "
                                      "written",
                                      file.string(), name, L, (c.in_dir / "config.json").string(),
                                      c.cfg.num_hidden_layers,
                                      c.extra_layers ? fmt::format(" and num_nextn_predict_layers {}", c.extra_layers)
                                                     : "",
                                      c.layer_end - 1));
}

// Routed experts with a bias cannot be LUT-B (spec 6).
void check_no_expert_bias(const PlanContext& c, const std::string& name) {
  if (name.find(".experts.") != std::string::npos && name.size() > 4 && name.compare(name.size() - 4, 4, "bias") == 0 &&
      c.cfg.is_moe_layer(layer_of(name)))
    throw CheckpointError(fmt::format("checkpoint {}: routed experts have a bias ({}): LUT-B online MoE quantization "
                                      "does not support bias.",
                                      c.in_dir.string(), name));
}

// The layer index of a routed-expert name must fit 63 bits.
void check_layer_index(const fs::path& file, const std::string& name, const std::smatch& m) {
  if (index_of(m[1].str()) < 0)
    throw CheckpointError(fmt::format("{}: tensor {} has a layer index that does not fit 63 bits; nothing written",
                                      file.string(), name));
}

// Routed experts in a layer config.json makes dense (first_k_dense_replace, mlp_only_layers,
// decoder_sparse_step, moe_layer_freq): the config and the weights disagree, so neither is copied.
void check_expert_in_moe_layer(const PlanContext& c, const fs::path& file, const std::string& name,
                               const std::smatch& m) {
  if (c.cfg.is_moe_layer(index_of(m[1].str()))) return;
  const auto ml = c.cfg.moe_layers();
  throw CheckpointError(fmt::format(
      "{}: tensor {} is a routed expert of layer {}, but {} makes layer {} a dense layer (its MoE layers: {}); "
      "the config and the weights disagree; nothing written",
      file.string(), name, m[1].str(), (c.in_dir / "config.json").string(), m[1].str(),
      ml.empty() ? std::string("none") : fmt::format("{}", fmt::join(ml, ", "))));
}

// A routed expert's dtype, rank and shape, as the loader checks them, so that a checkpoint eval
// would refuse is refused before anything is written. Returns the expert index (-1 when stacked).
std::int64_t check_routed_expert(const PlanContext& c, const fs::path& file, const std::string& name,
                                 const TensorView& v, const std::smatch& m, bool stacked, bool down) {
  if (!dtype_is_float_source(v.dtype))
    throw CheckpointError(fmt::format("{}: routed-expert tensor {} has dtype {}; LUT-B quantisation needs BF16, "
                                      "F16, F32 or F64 weights; nothing written",
                                      file.string(), name, dtype_name(v.dtype)));
  if (v.shape.size() != (stacked ? 3u : 2u) || v.numel() == 0)
    throw CheckpointError(fmt::format("{}: routed-expert tensor {} has shape {}, expected {}; nothing written",
                                      file.string(), name, detail::shape_str(v.shape),
                                      stacked ? "[E, N, K]" : "[N, K]"));
  const std::int64_t H = c.cfg.hidden_size, I = c.cfg.moe_intermediate_size, E = c.cfg.num_experts;
  std::vector<std::int64_t> expected;
  if (stacked)
    expected = down ? std::vector<std::int64_t>{E, H, I} : std::vector<std::int64_t>{E, 2 * I, H};
  else
    expected = down ? std::vector<std::int64_t>{H, I} : std::vector<std::int64_t>{I, H};
  if (v.shape != expected)
    throw CheckpointError(fmt::format(
        "{}: routed-expert tensor {} has shape {}, expected {} from {} (hidden_size {}, {} {}{}); nothing "
        "written",
        file.string(), name, detail::shape_str(v.shape), detail::shape_str(expected),
        (c.in_dir / "config.json").string(), H, "expert width", I, stacked ? fmt::format(", {} experts", E) : ""));
  const std::int64_t expert = stacked ? -1 : index_of(m[2].str());
  if (!stacked && (expert < 0 || expert >= E))
    throw CheckpointError(fmt::format("{}: routed-expert tensor {} names expert {}, but {} declares {} experts; "
                                      "nothing written",
                                      file.string(), name, m[2].str(), (c.in_dir / "config.json").string(), E));
  return expert;
}

// One tensor of one shard: the checkers above, then its entry in the plan.
Planned plan_tensor(const PlanContext& c, const fs::path& file, const std::string& name, const TensorView& v,
                    Plan& plan) {
  Planned p{name, false, {}};
  check_declared_layer(c, file, name);
  check_no_expert_bias(c, name);
  std::smatch m;
  if (!std::regex_match(name, m, c.pattern)) return p;
  check_layer_index(file, name, m);
  check_expert_in_moe_layer(c, file, name, m);
  const bool stacked = name.find("_proj.weight") == std::string::npos && name.find(".weight") == std::string::npos;
  const std::string proj = stacked ? m[4].str() : m[3].str();
  const bool down = proj == "down_proj" || proj == "w2";
  const std::int64_t expert = check_routed_expert(c, file, name, v, m, stacked, down);
  LayerExperts& le = plan.found[index_of(m[1].str())];
  if (stacked)
    (down ? le.down : le.gate_up) = true;
  else
    le.per_expert.insert({expert, static_cast<int>(proj_of(proj))});
  p.quantize = true;
  p.shape = shape_of(v);
  if (p.shape.padded()) plan.logical_shapes[name] = logical_dims(p.shape);
  return p;
}

// Step 2: every tensor of every shard, checked and classified before anything is written.
Plan plan_tensors(const PlanContext& c, QuantizeSummary& sum) {
  const auto& files = c.ck.tensors().files();
  Plan plan;
  plan.shards.resize(files.size());
  for (std::size_t f = 0; f < files.size(); ++f) {
    for (const auto& name : files[f]->names()) {
      // A tensor of a shard that model.safetensors.index.json leaves out is not a tensor of the
      // checkpoint: lutb eval and lutb moe do not read it (SafetensorsCollection follows the index), so
      // it is left out with a warning; a routed expert left out is then reported missing
      // (check_experts_complete, naming the shard).
      if (!c.ck.tensors().contains(name)) {
        sum.warnings.push_back(fmt::format("{}: tensor {} is not listed in {}'s weight_map, so it is not part of the "
                                           "checkpoint (lutb does not read it); not copied",
                                           files[f]->path().string(), name,
                                           (c.in_dir / "model.safetensors.index.json").string()));
        continue;
      }
      const TensorView& v = files[f]->get(name);
      Planned p = plan_tensor(c, files[f]->path(), name, v, plan);
      plan.total_bytes += v.nbytes;
      sum.input_bytes += v.nbytes;
      plan.shards[f].push_back(std::move(p));
    }
  }
  return plan;
}

bool plans_a_quantisation(const Plan& plan) {
  return std::any_of(plan.shards.begin(), plan.shards.end(), [](const auto& v) {
    return std::any_of(v.begin(), v.end(), [](const Planned& p) { return p.quantize; });
  });
}

// No routed-expert tensor to quantise: says why, when the names say it. LUT-B expert tensors and no
// float ones are a LUT-B checkpoint whose config.json lost its quantization_config; otherwise the
// check eval and moe apply (misspelt expert names, experts in dense layers); else the expected names.
[[noreturn]] void refuse_no_experts(const PlanContext& c) {
  constexpr std::string_view kPacked = "_packed";  // spec 2.2: P.weight_packed beside _codebook, _scale
  for (const auto& n : c.ck.tensors().names())
    if (n.size() > kPacked.size() && n.compare(n.size() - kPacked.size(), kPacked.size(), kPacked) == 0 &&
        std::regex_match(n.substr(0, n.size() - kPacked.size()), c.pattern))
      throw CheckpointError(fmt::format(
          "{}: the checkpoint is already LUT-B: it holds LUT-B routed-expert tensors ({} in {}) and no float ones, "
          "but {} has no LUT-B quantization_config (the \"quantization_config\" with \"quant_method\": \"lut_b\" "
          "that says how to read them, spec 2.2): restore the config.json written with these weights to run them; "
          "to quantise, start from the original BF16 checkpoint; nothing written",
          c.in_dir.string(), n, c.ck.tensors().file_of(n).path().string(), (c.in_dir / "config.json").string()));
  (void)detail::check_tensor_names(c.cfg, c.ck.tensors(), c.in_dir / "config.json", "copied unquantised",
                                   "; nothing written");
  std::int64_t first = 0;  // the first MoE layer (not moe_layers(): it lists them all)
  while (first < c.cfg.num_hidden_layers && !c.cfg.is_moe_layer(first)) ++first;
  throw CheckpointError(fmt::format("checkpoint {}: no routed-expert tensors found (expected names like {} or {})",
                                    c.in_dir.string(), expert_weight_name(c.cfg, first, 0, Proj::gate),
                                    stacked_gate_up_name(c.cfg, first)));
}

// Per-expert gate / up of width I % 8 != 0 are valid LUT-B tensors (spec 2.2: each padded to whole
// 8-row tiles), but lutb runs an expert's gate and up as one [2I, H] matrix of 8-row tiles, which
// the padded tiles cannot form (Checkpoint::lutb_experts refuses them): written, with a warning and
// the remedies.
void warn_unpaired_padding(const PlanContext& c, const Plan& plan, const fs::path& out_dir, QuantizeSummary& sum) {
  if (c.cfg.moe_intermediate_size % 8 == 0) return;
  for (const auto& [L, x] : plan.found)
    if (!x.per_expert.empty()) {
      sum.warnings.push_back(fmt::format(
          "{}: the expert width moe_intermediate_size {} of {} is not a multiple of 8 and the experts are stored "
          "per expert (e.g. {}): each LUT-B gate and up tensor is padded to {} rows, a valid LUT-B checkpoint "
          "(spec 2.2), but lutb eval and lutb moe cannot run it (they run an expert's gate and up as one [2I, H] "
          "matrix of 8-row tiles). To run LUT-B weights of this model with lutb, quantise a checkpoint with stacked "
          "experts (gate_up_proj [E, 2I, H]) or run the BF16 checkpoint with --quant lutb",
          out_dir.string(), c.cfg.moe_intermediate_size, (c.in_dir / "config.json").string(),
          expert_weight_name(c.cfg, L, 0, Proj::gate), (c.cfg.moe_intermediate_size + 7) / 8 * 8));
      return;
    }
}

// Step 3: the tensors the model reads besides the routed experts (QuantizeOptions::check_model), so
// that a router of the wrong shape, a missing embedding or an integer norm is refused now, not by
// lutb eval after the whole run. Returns the tensors to scan for NaN / Inf while they are copied.
std::set<std::string> check_model_tensors(const QuantizeOptions& opt, const fs::path& in_dir) {
  std::set<std::string> scan_finite;
  if (!opt.check_model) return scan_finite;
  try {
    for (auto& n : opt.check_model(in_dir)) scan_finite.insert(std::move(n));
  } catch (const Interrupted&) {
    throw;
  } catch (const std::exception& e) {
    throw CheckpointError(fmt::format("{}; nothing written", e.what()));
  }
  return scan_finite;
}

// The shard's path as the index names it, relative to the checkpoint (shards may sit in subfolders:
// a/w.safetensors and b/w.safetensors are two shards), else its file name.
std::string shard_name(const fs::path& file, const fs::path& in_dir) {
  const fs::path rel = file.lexically_normal().lexically_relative(in_dir.lexically_normal());
  return rel.empty() || *rel.begin() == ".." ? file.filename().generic_string() : rel.generic_string();
}

// Step 4: free space, before anything is written, as lutb synth checks it: the tensors as written,
// the files copied beside them, and 64 KiB per shard for headers, config.json and the index. The old
// output of --force is removed only after the new one is complete, so it does not count as available.
void check_space(const SafetensorsCollection& st, const Plan& plan, const fs::path& in_dir, const fs::path& out_dir) {
  const auto& files = st.files();
  std::uint64_t need = static_cast<std::uint64_t>(files.size() + 2) * (64u << 10);
  std::set<std::string> shards;
  for (std::size_t f = 0; f < files.size(); ++f) {
    const fs::path rel = files[f]->path().lexically_normal().lexically_relative(in_dir.lexically_normal());
    shards.insert(rel.empty() || *rel.begin() == ".." ? files[f]->path().filename().string() : rel.string());
    for (const auto& p : plan.shards[f])
      need += p.quantize ? static_cast<std::uint64_t>(p.shape.tiles()) * (kPackedBytes + kCodebookSize + 1)
                         : files[f]->get(p.name).nbytes;
  }
  detail::check_free_space(out_dir, need + bytes_to_copy(in_dir, shards));
}

// Step 5: the shards, one at a time, tensor by tensor (the fit happens in emit). Returns the new
// weight map and fills `shard_names` with the shards written.
nlohmann::json write_shards(const SafetensorsCollection& st, const Plan& plan, const fs::path& in_dir,
                            const fs::path& tmp, const fs::path& out_dir, const QuantizeOptions& opt,
                            const std::set<std::string>& scan_finite, QuantizeSummary& sum,
                            std::set<std::string>& shard_names) {
  const auto& files = st.files();
  detail::Progress prog("quantize", plan.total_bytes, opt.progress);
  nlohmann::json weight_map = nlohmann::json::object();
  for (std::size_t f = 0; f < files.size(); ++f) {
    const std::string shard = shard_name(files[f]->path(), in_dir);
    shard_names.insert(fs::path(shard).string());
    if (fs::path(shard).has_parent_path()) fs::create_directories(tmp / fs::path(shard).parent_path());
    try {
      SafetensorsWriter w(tmp / shard, files[f]->metadata());
      for (const auto& p : plan.shards[f]) {
        declare(w, p, files[f]->get(p.name), sum);
        if (p.quantize) {
          const LutbNames n = lutb_names(p.name);
          for (const auto* s : {&n.packed, &n.codebook, &n.scale}) weight_map[*s] = shard;
        } else {
          weight_map[p.name] = shard;
        }
      }
      for (const auto& p : plan.shards[f])
        emit(w, p, files[f]->get(p.name), opt.fit, opt.fit_function, sum, prog, opt.interrupt, out_dir,
             files[f]->path(), scan_finite.count(p.name) > 0);
      w.commit();
    } catch (const SafetensorsError& e) {
      throw_write_error(e, tmp, out_dir);
    }
  }
  prog.finish();
  return weight_map;
}

// Step 6a: model.safetensors.index.json with the new weight map and total size (when the input had
// an index).
void write_index(const fs::path& in_dir, const fs::path& tmp, const nlohmann::json& weight_map,
                 const QuantizeSummary& sum) {
  const fs::path index = in_dir / "model.safetensors.index.json";
  if (!fs::exists(index)) return;
  nlohmann::json j;
  {
    std::ifstream in(index);
    try {
      j = nlohmann::json::parse(in);
    } catch (const nlohmann::json::exception& e) {
      throw CheckpointError(fmt::format("{}: invalid JSON: {}", index.string(), detail::json_error_text(e.what())));
    }
  }
  if (!j.contains("metadata") || !j["metadata"].is_object()) j["metadata"] = nlohmann::json::object();
  j["metadata"]["total_size"] = sum.output_bytes;
  j["weight_map"] = weight_map;
  write_text(tmp / "model.safetensors.index.json", j.dump(2) + "\n");
}

// Step 6b: config.json with the LUT-B quantization_config (spec 2.2).
void write_config(const ModelConfig& cfg, const Plan& plan, const fs::path& tmp, const QuantizeSummary& sum) {
  nlohmann::json config = cfg.raw;
  nlohmann::json ls = nlohmann::json::object();
  for (const auto& [k, v] : plan.logical_shapes) ls[k] = v;
  config["quantization_config"] = {
      {"quant_method", "lut_b"},
      {"format", "lut-b"},
      {"tile", {kTileRows, kTileCols}},
      {"index_bits", 3},
      {"codebook_size", kCodebookSize},
      {"codebook_dtype", "float8_e4m3fn"},
      {"scale_dtype", "ue8m0"},
      {"fitter", sum.fitter},
      {"activation", "mxfp8"},
      {"activation_block", 32},
      {"modules", routed_expert_pattern(cfg)},
      {"logical_shapes", ls},
  };
  write_text(tmp / "config.json", config.dump(2) + "\n");
}

// A file of the input folder that is not copied because it is not a regular file (a dangling link:
// a Hugging Face cache snapshot whose blob is missing, an incomplete download; a named pipe, a
// socket): listed, with a warning, so the output's missing tokenizer.json (say) is explained.
void skip_non_regular(const fs::recursive_directory_iterator& it, const fs::path& rel, QuantizeSummary& sum) {
  sum.skipped_files.push_back(rel.string());
  std::error_code lec;
  if (it->is_symlink())
    sum.warnings.push_back(fmt::format("{}: not copied: it is a symbolic link to {}, which {} (an incomplete "
                                       "download?)",
                                       it->path().string(), fs::read_symlink(it->path(), lec).string(),
                                       fs::exists(it->path(), lec) ? "is not a regular file" : "does not exist"));
  else
    sum.warnings.push_back(fmt::format("{}: not copied: not a regular file ({})", it->path().string(),
                                       detail::non_regular_kind(it->path())));
}

// Warnings for a copied file that may not belong in the LUT-B checkpoint: another safetensors file
// holding tensors of this checkpoint (a stray shard, a copy of model.safetensors: unquantised routed
// experts in the output), and a large file of unknown purpose (a model.pt, a PEFT adapter, logs). Both
// are the user's data, so they are copied and said; the small files a checkpoint carries (tokenizer,
// configs) are well below kLargeCopy.
void warn_copied_file(const Checkpoint& ck, const std::regex& pattern, const fs::recursive_directory_iterator& it,
                      const fs::path& rel, const fs::path& out_dir, QuantizeSummary& sum) {
  const std::string fname = rel.string();
  if (rel.extension() == ".safetensors") {
    try {
      const SafetensorsFile other(it->path());
      for (const auto& n : other.names())
        if (ck.contains(n) || std::regex_match(n, pattern)) {
          sum.warnings.push_back(fmt::format(
              "{}: copied {} unquantised: it holds tensor {}{} (a stray shard or a copy of the weights?); delete it "
              "from the output if the checkpoint's loader would read it",
              out_dir.string(), fname, n, ck.contains(n) ? " of this checkpoint" : ", a routed expert"));
          break;
        }
    } catch (const std::exception&) {
      // not a readable safetensors file: copied as any other file
    }
  }
  if (std::error_code sec; rel.extension() != ".safetensors" && it->file_size(sec) >= kLargeCopy && !sec)
    sum.warnings.push_back(fmt::format("{}: copied {} ({:.1f} MB) unchanged: it is not a file of a Hugging Face "
                                       "checkpoint lutb knows; delete it from the output if the checkpoint does not "
                                       "need it",
                                       out_dir.string(), fname, static_cast<double>(it->file_size()) / 1e6));
}

// Step 6c: every other file (tokenizer, generation config, ...), recursively, except the weights in
// another form, which would put the unquantised weights into the LUT-B checkpoint (a 90 GB
// consolidated.safetensors or pytorch_model*.bin beside the shards), training state, the source's
// reference losses and the source repository's caches.
// Names are taken LEXICALLY relative to the input folder: fs::relative resolves symlinks, so in a
// Hugging Face cache snapshot (every file a symlink to ../../blobs/<sha>) it would give
// "../../blobs/<sha>", and the copy through tmp / "../../blobs/<sha>" would truncate the source blob.
// A symlinked file is copied (its contents) under the link's own name; a symlinked folder is not
// descended into (the iterator does not follow it) and is left out.
void copy_other_files(const Checkpoint& ck, const std::regex& pattern, const fs::path& in_dir, const fs::path& tmp,
                      const fs::path& out_dir, const std::set<std::string>& shard_names, const QuantizeOptions& opt,
                      QuantizeSummary& sum) {
  for (auto it = fs::recursive_directory_iterator(in_dir); it != fs::recursive_directory_iterator(); ++it) {
    const fs::path rel = it->path().lexically_relative(in_dir);
    if (rel.empty() || *rel.begin() == "..")
      throw CheckpointError(fmt::format("{}: '{}' is not inside the input folder {}; nothing written", out_dir.string(),
                                        it->path().string(), in_dir.string()));
    if (it->is_directory()) {
      if (it->is_symlink()) {
        sum.skipped_files.push_back(rel.string() + "/");
        continue;
      }
      // The download cache of `huggingface-cli download --local-dir` (.cache/huggingface/, older
      // versions .huggingface/: the source files' hashes and locks) and version control (.git/,
      // whose LFS store holds the unquantised weights again) describe the source repository, not
      // this output: left out and listed.
      if (skipped_folder(rel.filename().string())) {
        sum.skipped_files.push_back(rel.string() + "/");
        it.disable_recursion_pending();
        continue;
      }
      fs::create_directories(tmp / rel);
      continue;
    }
    if (!it->is_regular_file()) {
      skip_non_regular(it, rel, sum);
      continue;
    }
    const std::string fname = rel.string();
    if (fname == "config.json" || fname == "model.safetensors.index.json" || shard_names.count(fname)) continue;
    if (other_weight_file(rel.filename().string()) || training_state_file(rel.filename().string()) ||
        source_reference_file(fname)) {
      sum.skipped_files.push_back(fname);
      continue;
    }
    detail::check_interrupt(opt.interrupt, out_dir);
    warn_copied_file(ck, pattern, it, rel, out_dir, sum);
    // Contents only: the output gets this process's default permissions, not the source's (a
    // read-only source must not make the copies read-only).
    detail::copy_file_contents(it->path(), tmp / rel, opt.interrupt, out_dir);
  }
}

}  // namespace

QuantizeSummary quantize_checkpoint(const fs::path& in_dir, const fs::path& out_arg, const QuantizeOptions& opt) {
  const double t0 = detail::now_seconds();
  const fs::path out_dir = detail::output_path(out_arg);  // "out/", "out/." -> "out"
  QuantizeSummary sum;
  sum.fitter = resolved_fitter(opt.fit);
  check_output(in_dir, out_dir, opt);

  Checkpoint ck(in_dir);
  const ModelConfig& cfg = ck.config();
  check_not_lutb(ck, in_dir);
  const std::regex pattern(routed_expert_pattern(cfg));
  const std::int64_t extra = extra_declared_layers(cfg);
  const PlanContext ctx{ck, cfg, in_dir, pattern, extra, cfg.num_hidden_layers + extra};

  const Plan plan = plan_tensors(ctx, sum);
  if (!plans_a_quantisation(plan)) refuse_no_experts(ctx);
  check_experts_complete(in_dir, cfg, ck.tensors(), plan.found);
  // Tensors the model does not have: a misspelt expert name is refused (it would be copied
  // unquantised, and the loaders would not read it); any other stray tensor is copied with a
  // warning. lutb eval and lutb moe apply the same check.
  for (auto& w : detail::check_tensor_names(cfg, ck.tensors(), in_dir / "config.json", "copied unquantised",
                                            "; nothing written"))
    sum.warnings.push_back(std::move(w));
  warn_unpaired_padding(ctx, plan, out_dir, sum);
  const std::set<std::string> scan_finite = check_model_tensors(opt, in_dir);
  check_space(ck.tensors(), plan, in_dir, out_dir);

  const fs::path tmp = detail::temp_sibling(out_dir);
  std::error_code ec;
  fs::remove_all(tmp, ec);
  // A missing parent is created, as lutb synth does, and removed again if the run fails.
  detail::CreatedParents parents;
  detail::create_parents(out_dir, parents);
  detail::create_temp_dir(tmp, out_dir);
  TempGuard guard{tmp};

  try {  // (with_target_left: what became of OUT, at the end of an error's message)
    std::set<std::string> shard_names;
    const nlohmann::json weight_map =
        write_shards(ck.tensors(), plan, in_dir, tmp, out_dir, opt, scan_finite, sum, shard_names);
    try {
      write_index(in_dir, tmp, weight_map, sum);
      write_config(cfg, plan, tmp, sum);
      copy_other_files(ck, pattern, in_dir, tmp, out_dir, shard_names, opt, sum);
    } catch (const CheckpointError& e) {
      if (std::string w = write_error_message(e.what(), tmp, out_dir); !w.empty()) throw CheckpointError(w);
      throw;
    }
  } catch (const CheckpointError& e) {
    throw CheckpointError(with_target_left(e.what(), out_dir));
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(with_target_left(e.what(), out_dir));
  }
  std::sort(sum.skipped_files.begin(), sum.skipped_files.end());

  // Step 7: commit.
  detail::check_interrupt(opt.interrupt, out_dir);
  detail::install_replacing(tmp, out_dir, /*want_directory=*/true, opt.force);
  guard.armed = false;
  parents.armed = false;
  sum.seconds = detail::now_seconds() - t0;
  sum.peak_rss_bytes = peak_rss_bytes();
  return sum;
}

namespace {

// ---------------------------------------------------------------------------
// quantize_file, step by step: check the arguments and the output, find the LUT-B tensors already
// in the file, plan, refuse what cannot be quantised, check the space, write, commit.
// ---------------------------------------------------------------------------

std::regex compile_match(const std::string& match) {
  std::regex re;
  if (!match.empty()) {
    try {
      re = std::regex(match);
    } catch (const std::regex_error& e) {
      throw std::invalid_argument(fmt::format("--match \"{}\": invalid regular expression: {}", match, e.what()));
    }
  }
  return re;
}

void check_file_output(const fs::path& in, const fs::path& out, const QuantizeOptions& opt) {
  if (same_path(in, out)) throw CheckpointError(fmt::format("{}: the output file is the input file", out.string()));
  detail::check_output_location(in, out);
  detail::check_replaceable(out, /*want_directory=*/false, opt.force);
  if (fs::exists(out) && !opt.force)
    throw CheckpointError(fmt::format("{}: output file exists (use --force to replace it); nothing written", out.string()));
  // A safetensors file named like a folder ("lutb quantize DIR/model.safetensors -o OUT_DIR") would
  // then be refused by --force: the output must be named like what it is.
  if (out.extension() != ".safetensors")
    throw CheckpointError(fmt::format("{}: the output of one quantised file must be named *.safetensors (to write a "
                                      "checkpoint directory, give the input checkpoint directory); nothing written",
                                      out.string()));
}

// LUT-B tensors already in the file (X_packed U8 beside X_codebook): the file is already LUT-B, which
// says more than "only 2-D or 3-D float tensors can be quantised", and --all must not quantise the
// float tensors a LUT-B checkpoint keeps unquantised (router, attention).
struct LutbParts {
  std::map<std::string, std::string> part;  // each LUT-B tensor's name -> the quantised weight's name X
  std::string first;                        // the first quantised weight by name (stable messages)
  std::string example;                      // "X_packed with X_codebook and X_scale, and N more LUT-B weights"
};

LutbParts find_lutb_parts(const SafetensorsFile& file) {
  LutbParts l;
  for (const auto& name : file.names()) {
    static constexpr std::string_view kPacked = "_packed";
    if (name.size() <= kPacked.size() || name.compare(name.size() - kPacked.size(), kPacked.size(), kPacked) != 0) continue;
    const std::string base = name.substr(0, name.size() - kPacked.size());
    const LutbNames n = lutb_names(base);
    if (n.packed != name || file.get(name).dtype != DType::U8 || !file.contains(n.codebook)) continue;
    for (const auto* x : {&n.packed, &n.codebook, &n.scale}) l.part[*x] = base;
    if (l.first.empty() || base < l.first) l.first = base;  // the first by name: stable messages
  }
  const std::size_t count = static_cast<std::size_t>(std::count_if(
      l.part.begin(), l.part.end(), [](const auto& kv) { return kv.first == lutb_names(kv.second).packed; }));
  if (!l.first.empty())
    l.example = fmt::format("{} with {} and {}{}", lutb_names(l.first).packed, lutb_names(l.first).codebook,
                            lutb_names(l.first).scale,
                            count > 1 ? fmt::format(", and {} more LUT-B weights", count - 1) : "");
  return l;
}

// Whether one tensor is quantised: every quantisable tensor without --match; with it, a matching
// tensor that is not LUT-B already and is quantisable (else refused).
bool selected(const fs::path& in, const std::string& name, const TensorView& v, const std::string& match,
              const std::regex& re, const LutbParts& lutb) {
  if (match.empty()) return quantizable(v);
  if (!std::regex_search(name, re)) return false;
  if (const auto it = lutb.part.find(name); it != lutb.part.end())
    throw CheckpointError(fmt::format(
        "{}: tensor {} matches --match \"{}\" but is already LUT-B (part of the quantised weight {}: {}, {}, {}) "
        "and cannot be quantised again; to quantise {} anew (e.g. with another --fitter), start from the original "
        "float file; to quantise other tensors, narrow --match; nothing written",
        in.string(), name, match, it->second, lutb_names(it->second).packed, lutb_names(it->second).codebook,
        lutb_names(it->second).scale, it->second));
  if (!quantizable(v))
    throw CheckpointError(fmt::format("{}: tensor {} matches --match \"{}\" but is {} {}; only 2-D [N, K] or 3-D "
                                      "[E, N, K] BF16/F16/F32 tensors can be quantised",
                                      in.string(), name, match, dtype_name(v.dtype), detail::shape_str(v.shape)));
  return true;
}

// Every tensor of the file, quantised or copied; the logical shapes of padded tensors go to `meta`.
std::vector<Planned> plan_file(const SafetensorsFile& file, const fs::path& in, const fs::path& out,
                               const std::string& match, const std::regex& re, const LutbParts& lutb,
                               const QuantizeOptions& opt, std::map<std::string, std::string>& meta,
                               std::uint64_t& total, QuantizeSummary& sum) {
  std::vector<Planned> plan;
  for (const auto& name : file.names()) {
    detail::check_interrupt(opt.interrupt, out);  // matching a slow --match over many names
    const TensorView& v = file.get(name);
    Planned p{name, false, {}};
    p.quantize = selected(in, name, v, match, re, lutb);
    if (p.quantize) {
      p.shape = shape_of(v);
      const LutbNames n = lutb_names(name);
      for (const auto* s : {&n.packed, &n.codebook, &n.scale})
        if (file.contains(*s))
          throw CheckpointError(fmt::format("{}: cannot quantise {}: the file already has a tensor named {}", in.string(),
                                            name, *s));
      if (p.shape.padded()) meta["lutb.logical_shape." + name] = detail::shape_str(logical_dims(p.shape));
    }
    total += v.nbytes;
    sum.input_bytes += v.nbytes;
    plan.push_back(std::move(p));
  }
  return plan;
}

// Without --match, a file that already holds LUT-B tensors is refused: there is nothing left to
// quantise, or --all would quantise float tensors a LUT-B checkpoint keeps unquantised.
void check_not_partly_lutb(const std::vector<Planned>& plan, const LutbParts& lutb, const fs::path& in,
                           const std::string& match) {
  if (!match.empty() || lutb.first.empty()) return;
  const auto n = std::count_if(plan.begin(), plan.end(), [](const Planned& p) { return p.quantize; });
  const auto first = std::find_if(plan.begin(), plan.end(), [](const Planned& p) { return p.quantize; });
  if (n == 0)
    throw CheckpointError(fmt::format("{}: the file is already LUT-B ({}) and holds no float tensor left to quantise; "
                                      "nothing to do: to quantise anew (e.g. with another --fitter), start from the "
                                      "original float file; nothing written",
                                      in.string(), lutb.example));
  throw CheckpointError(fmt::format(
      "{}: the file already holds LUT-B tensors ({}); --all (the default without --match) would quantise its {} "
      "remaining float tensor{} too (e.g. {}), which a LUT-B checkpoint keeps unquantised. To quantise some of them, "
      "name them with --match REGEX; to quantise anew, start from the original float file; nothing written",
      in.string(), lutb.example, n, n == 1 ? "" : "s", first->name));
}

// Free space first, as for a checkpoint (64 KiB for the header).
void check_file_space(const SafetensorsFile& file, const std::vector<Planned>& plan, const fs::path& out) {
  std::uint64_t need = 64u << 10;
  for (const auto& p : plan)
    need += p.quantize ? static_cast<std::uint64_t>(p.shape.tiles()) * (kPackedBytes + kCodebookSize + 1)
                       : file.get(p.name).nbytes;
  detail::check_free_space(out, need, "the output file");
}

}  // namespace

QuantizeSummary quantize_file(const fs::path& in, const fs::path& out_arg, const std::string& match,
                              const QuantizeOptions& opt) {
  const double t0 = detail::now_seconds();
  const fs::path out = detail::output_path(out_arg);  // "out.safetensors/." -> "out.safetensors"
  QuantizeSummary sum;
  sum.fitter = resolved_fitter(opt.fit);
  check_threads(opt.fit);
  // The arguments before the file system: an invalid --match is reported before the checks of the
  // output.
  const std::regex re = compile_match(match);
  check_file_output(in, out, opt);
  SafetensorsFile file(in);
  const LutbParts lutb = find_lutb_parts(file);
  std::map<std::string, std::string> meta = file.metadata();
  std::uint64_t total = 0;
  const std::vector<Planned> plan = plan_file(file, in, out, match, re, lutb, opt, meta, total, sum);
  check_not_partly_lutb(plan, lutb, in, match);
  if (std::none_of(plan.begin(), plan.end(), [](const Planned& p) { return p.quantize; }))
    throw CheckpointError(match.empty()
                              ? fmt::format("{}: no 2-D or 3-D float tensor to quantise", in.string())
                              : fmt::format("{}: no tensor matches --match \"{}\"", in.string(), match));
  meta["lutb.quant_method"] = "lut_b";
  meta["lutb.fitter"] = sum.fitter;
  meta["lutb.tile"] = "[8, 64]";
  check_file_space(file, plan, out);

  // Written to a temporary sibling, then installed (the writer itself is atomic too).
  const fs::path tmp = detail::temp_sibling(out);
  {
    std::error_code ec;
    fs::remove(tmp, ec);
  }
  // The writer builds `tmp` under its own temporary name, tmp.tmp.PID: probe that one too (first: it
  // is the longer, so its error gives the binding limit), so that an output name 236-245 bytes long is
  // refused before any tensor is fitted, naming the output rather than the internal
  // "OUT.tmp.PID.tmp.PID".
  detail::CreatedParents parents;  // a missing parent is created (as lutb synth), removed if the run fails
  detail::create_parents(out, parents);
  detail::probe_temp_file(detail::temp_sibling(tmp), out);
  detail::probe_temp_file(tmp, out);
  TempGuard guard{tmp};
  {
    detail::Progress prog("quantize", total, opt.progress);
    try {
      SafetensorsWriter w(tmp, meta);
      for (const auto& p : plan) declare(w, p, file.get(p.name), sum);
      for (const auto& p : plan)
        emit(w, p, file.get(p.name), opt.fit, opt.fit_function, sum, prog, opt.interrupt, out, in, false);
      w.commit();
    } catch (const SafetensorsError& e) {
      throw_write_error(e, tmp, out);
    }
    prog.finish();
  }
  detail::check_interrupt(opt.interrupt, out);
  detail::install_replacing(tmp, out, /*want_directory=*/false, opt.force);
  guard.armed = false;
  parents.armed = false;
  sum.seconds = detail::now_seconds() - t0;
  sum.peak_rss_bytes = peak_rss_bytes();
  return sum;
}

}  // namespace lutb
