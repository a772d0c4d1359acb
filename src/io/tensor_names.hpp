// Tensor names of a checkpoint against what its config.json describes, for `lutb quantize`
// (checkpoint mode), `lutb eval` and `lutb moe`: one classification, so that both commands treat a
// stray or misspelt tensor alike and says so.
#pragma once

#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "lutb/checkpoint.hpp"
#include "lutb/safetensors.hpp"

namespace lutb::detail {

/// Checks every tensor name of `st` against the model `cfg` (parsed from `config_path`) describes:
///  - the model's tensors (embeddings, norms, attention of the family, dense MLPs of dense layers,
///    router, routed experts, shared experts of MoE layers; LUT-B experts when cfg.raw has a LUT-B
///    quantization_config) and known extra tensors (rotary_emb.inv_freq, a tied lm_head, DeepSeek-V3's
///    num_nextn_predict_layers layers) pass;
///  - a name that looks like an expert tensor but is not one the model reads (a misspelt
///    projection, an expert index beyond the experts count, experts in a dense layer, LUT-B tensors
///    in a checkpoint whose config has no LUT-B quantization_config) throws CheckpointError naming
///    the file, the tensor, config.json and what was expected, followed by `error_suffix`;
///  - any other name is returned as a warning naming the file and the tensor, ending with
///    `consequence` ("lutb eval does not read it", "copied unquantised"); beyond 5, one more line
///    counts the rest.
/// Tensors of layers beyond the config are left to the callers' own check (they refuse them).
std::vector<std::string> check_tensor_names(const ModelConfig& cfg, const SafetensorsCollection& st,
                                            const std::filesystem::path& config_path, std::string_view consequence,
                                            std::string_view error_suffix);

}  // namespace lutb::detail
