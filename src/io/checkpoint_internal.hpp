// Internal helpers of the checkpoint reader/writer (not public API).
#pragma once

#include <atomic>
#include <filesystem>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "lutb/dtype.hpp"

namespace lutb::detail {

/// Converts n elements of a float dtype (F32, BF16, F16, F64) to FP32.
void convert_to_f32(const void* src, DType t, float* out, std::int64_t n);
/// "[a, b, c]".
std::string shape_str(const std::vector<std::int64_t>& s);
/// Drops the pages of [p, p+n) of a read-only file mapping from this process's resident set
/// (madvise MADV_DONTNEED on the whole pages inside the range); the data stays readable (it is
/// faulted back in from the file). No-op for n == 0.
void release_pages(const void* p, std::size_t n);

/// Why lutb quantize left `rel` (an entry of QuantizeSummary::skipped_files: a path relative to the
/// input folder, "NAME/" for a folder) out of its output, in a few words for the summary's "not
/// copied" line: "the weights in another format", "training state", "the source weights' reference
/// losses, spec section 8", "version control", "download cache", "a symbolic link to a folder, not
/// followed", "not a regular file: see the warning".
std::string skipped_file_reason(const std::string& rel);

/// A one-line progress bar on stderr, drawn only when stderr is a terminal.
class Progress {
 public:
  Progress(std::string label, std::uint64_t total, bool enabled);
  ~Progress();
  void advance(std::uint64_t n);
  void finish();

 private:
  void draw(bool force);
  std::string label_;
  std::uint64_t total_, done_ = 0;
  bool enabled_;
  double start_, last_ = -1.0;
  bool finished_ = false;
};

/// Monotonic seconds.
double now_seconds();

/// Refuses an output location that would destroy or recurse into the input: `out` equal to `in`,
/// inside it, or containing it (a --force swap of a parent would delete the input), or, for a
/// directory input, a link below `in` that resolves into an existing `out`. Throws CheckpointError
/// naming both paths (and the link).
void check_output_location(const std::filesystem::path& in, const std::filesystem::path& out);

/// Refuses a checkpoint-directory output named "*.safetensors" (a trailing separator ignored): it
/// would be written as a folder that every reader takes for one file (`lutb quantize MODEL_DIR -o
/// q.safetensors`, `lutb synth -o s.safetensors`). Throws CheckpointError naming the path; `what`
/// is the command ("quantize", "synth") for the remedy.
void check_directory_output_name(const std::filesystem::path& out_dir, const char* what);

/// Refuses to replace an existing `target` of the other kind: a directory output never replaces a
/// file and a file output never replaces a directory, even with --force. With `force` it also
/// refuses a target that does not look like this tool's output: the current directory or an
/// ancestor of it, a file that is not a regular *.safetensors, a directory holding anything but
/// regular checkpoint files (*.safetensors, *.json, tokenizer*, merges.txt, ...) unless its
/// config.json says this tool wrote it (quantization_config.quant_method "lut_b", or a synth
/// output's "lutb_synthetic"): quantize copies a source's README.md, LICENSE, subfolders, ... into
/// its output. No-op when absent.
/// Throws CheckpointError naming the path (and the offending entry) before anything is changed.
void check_replaceable(const std::filesystem::path& target, bool want_directory, bool force);

/// Moves directory or file `tmp` to `target`. When `target` is absent it is created with
/// renameat2(RENAME_NOREPLACE), so one that appears at that moment is never replaced. When it exists
/// (the caller checked it at the start, but it may have appeared during the run): without `force`
/// CheckpointError ("appeared while the output was being written"), tmp left for the caller's
/// guard; with `force` check_replaceable(target, want_directory, true) again, then the old target
/// is renamed aside, the new one renamed in and the old one removed; on failure the old one is put
/// back.
void install_replacing(const std::filesystem::path& tmp, const std::filesystem::path& target, bool want_directory,
                       bool force);

/// Creates the temporary directory `tmp` of output `target`; on failure (permissions, a parent that
/// is a file, ...) throws CheckpointError naming `target`, the user's path, not the temporary one.
void create_temp_dir(const std::filesystem::path& tmp, const std::filesystem::path& target);
/// The missing ancestor directories of output `target`, created (as mkdir -p) by create_parents and
/// removed again, deepest first and only while empty, when destroyed armed: a failed or interrupted run
/// leaves the file system as it was. lutb quantize and lutb synth both create a missing parent.
struct CreatedParents {
  std::vector<std::filesystem::path> made;  // deepest first
  bool armed = true;
  CreatedParents() = default;
  CreatedParents(const CreatedParents&) = delete;
  CreatedParents& operator=(const CreatedParents&) = delete;
  ~CreatedParents();
};
/// Creates the missing ancestors of `target` into `out`. Throws CheckpointError "TARGET: cannot create
/// its parent directory DIR: REASON; nothing written" (no permission, a name too long); `out` removes
/// what was created.
void create_parents(const std::filesystem::path& target, CreatedParents& out);
/// Checks that file `tmp` can be created (creates and removes it); else as create_temp_dir.
void probe_temp_file(const std::filesystem::path& tmp, const std::filesystem::path& target);

/// Throws CheckpointError "TARGET: the checkpoint needs X GB (N bytes) but only ... are free on the
/// filesystem of DIR; nothing written" when the filesystem that will hold `target` (its nearest
/// existing ancestor) has fewer than `need` bytes available. A failing statvfs is not an error.
/// `what` names the output in the message ("the checkpoint"; quantize_file: "the output file").
void check_free_space(const std::filesystem::path& target, std::uint64_t need, std::string_view what = "the checkpoint");

/// The output path as given, less trailing separators and "." components: "out/" and "out/." are
/// "out" (with "-o newq/." kept as given, the temporary would be "newq/..tmp.PID", which cannot be
/// renamed to the output at the end). "." and "/" stay as they
/// are (the --force rules refuse them).
std::filesystem::path output_path(const std::filesystem::path& p);

/// Temporary sibling name of `target`: "<target>.tmp.<pid>" (a trailing separator is ignored).
/// stale_temporaries() recognises these names.
std::filesystem::path temp_sibling(const std::filesystem::path& target);

/// What a failed or interrupted run left at `target`, for the end of its error message: "T is as it
/// was" when `target` exists (it was there before the run, which never replaces it before the final
/// rename) and "nothing was created at T" when it does not.
std::string target_left_clause(const std::filesystem::path& target);

/// Throws Interrupted naming `target` when `flag` is set (nonzero). No-op for a null flag.
void check_interrupt(const std::atomic<int>* flag, const std::filesystem::path& target);

/// Copies the bytes of regular file `from` to a new file `to` (replaced when it exists) created with
/// the default mode 0666 minus the umask, like any file this program writes. Unlike
/// std::filesystem::copy_file it does not carry the source's permission bits over: a read-only
/// source must not give a read-only output. Throws CheckpointError naming the file on failure.
/// With `stop` non-null the flag is polled per MB; when set, the partial copy is left for the
/// caller's guard and Interrupted is thrown (check_interrupt with `target`, naming `from`).
void copy_file_contents(const std::filesystem::path& from, const std::filesystem::path& to,
                        const std::atomic<int>* stop = nullptr, const std::filesystem::path& target = {});

/// Writes `text` to a new file `path` (replaced when it exists, mode 0666 minus the umask) and fsyncs
/// it, so that a checkpoint's small files (config.json, the shard index) are on disk before the
/// output folder is renamed into place. Throws CheckpointError naming the file and the errno reason.
void write_text_file(const std::filesystem::path& path, const std::string& text);

/// fsync of a directory's entries (best effort: errors are ignored, as some file systems refuse it).
void sync_directory(const std::filesystem::path& dir);

}  // namespace lutb::detail
