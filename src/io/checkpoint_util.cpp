// Internal helpers: page release, progress bar, timing, peak RSS, summaries.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>

#include <fmt/core.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "io/checkpoint_internal.hpp"
#include "lutb/checkpoint.hpp"

namespace lutb {

namespace fs = std::filesystem;

namespace detail {

void release_pages(const void* p, std::size_t n) {
  if (n == 0 || p == nullptr) return;
  static const std::uintptr_t page = static_cast<std::uintptr_t>(sysconf(_SC_PAGESIZE));
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  const std::uintptr_t begin = (a + page - 1) / page * page;  // whole pages inside the range only
  const std::uintptr_t end = (a + n) / page * page;
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

double now_seconds() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

Progress::Progress(std::string label, std::uint64_t total, bool enabled)
    : label_(std::move(label)), total_(total), enabled_(enabled && isatty(STDERR_FILENO)), start_(now_seconds()) {}

Progress::~Progress() {
  if (enabled_ && !finished_ && last_ >= 0) std::fputs("\n", stderr);
}

void Progress::advance(std::uint64_t n) {
  done_ += n;
  draw(false);
}

void Progress::finish() {
  if (finished_) return;
  draw(true);
  if (enabled_ && last_ >= 0) std::fputs("\n", stderr);
  finished_ = true;
}

void Progress::draw(bool force) {
  if (!enabled_) return;
  const double t = now_seconds();
  if (!force && last_ >= 0 && t - last_ < 0.2) return;
  if (!force && last_ < 0 && t - start_ < 0.5) return;  // short runs draw nothing
  last_ = t;
  const double frac = total_ ? std::min(1.0, static_cast<double>(done_) / static_cast<double>(total_)) : 1.0;
  const int width = 30, fill = static_cast<int>(frac * width);
  const double el = t - start_;
  const double eta = frac > 0 ? el * (1.0 - frac) / frac : 0.0;
  fmt::print(stderr, "\r{} [{}{}] {:5.1f}%  {:.0f}s elapsed, ~{:.0f}s left ", label_, std::string(fill, '#'),
             std::string(width - fill, '.'), 100.0 * frac, el, eta);
  std::fflush(stderr);
}


namespace {
// A path made absolute and normalised, links resolved where it can be: when the file system cannot
// resolve it (a name longer than NAME_MAX, a loop of links), weakly_canonical returns an empty path,
// which path_within must not take for the root of everything (then every output would "contain
// the input").
std::filesystem::path resolved_path(const std::filesystem::path& p) {
  std::error_code ec;
  const auto abs = std::filesystem::absolute(p, ec);
  if (ec) return p.lexically_normal();
  auto c = std::filesystem::weakly_canonical(abs, ec);
  if (ec || c.empty()) return abs.lexically_normal();
  return c;
}
// True when `inner` is `outer` or lies below it (both made absolute and normalised, links resolved
// where the paths exist).
bool path_within(const std::filesystem::path& inner, const std::filesystem::path& outer) {
  const auto a = resolved_path(inner);
  const auto b = resolved_path(outer);
  if (a.empty() || b.empty()) return false;
  auto ia = a.begin();
  for (auto ib = b.begin(); ib != b.end(); ++ib) {
    if (ib->empty()) continue;  // trailing separator
    if (ia == a.end() || *ia != *ib) return false;
    ++ia;
  }
  return true;
}
// Names a checkpoint directory holds (what quantize, synth or a model download writes): tensors,
// JSON configs and indexes, tokenizer files. Conservative on purpose: anything else (notes, code,
// subdirectories) makes --force refuse.
bool checkpoint_entry_name(const std::string& name) {
  auto ends = [&](const char* suf) {
    const std::size_t n = std::strlen(suf);
    return name.size() > n && name.compare(name.size() - n, n, suf) == 0;
  };
  if (name.empty() || name[0] == '.') return false;
  if (ends(".safetensors") || ends(".json") || ends(".tiktoken")) return true;
  if (name.rfind("tokenizer", 0) == 0) return true;  // tokenizer.json, tokenizer.model, ...
  return name == "merges.txt" || name == "vocab.txt" || name == "spiece.model" || name == "sentencepiece.model";
}
}  // namespace

void check_directory_output_name(const std::filesystem::path& out_dir, const char* what) {
  const fs::path name = out_dir.has_filename() ? out_dir.filename() : out_dir.parent_path().filename();
  if (name.extension() != ".safetensors") return;
  const std::string remedy =
      std::string(what) == "quantize"
          ? "to quantise the tensors of one file, give that .safetensors file as the input"
          : "a checkpoint is a folder of config.json and *.safetensors files";
  throw CheckpointError(fmt::format("{}: a checkpoint directory must not be named *.safetensors (readers take that "
                                    "name for one safetensors file; {}); nothing written",
                                    out_dir.string(), remedy));
}

void check_output_location(const std::filesystem::path& in, const std::filesystem::path& out) {
  if (path_within(out, in))
    throw CheckpointError(fmt::format("{}: the output lies inside (or is) the input {}; choose a path outside it",
                                      out.string(), in.string()));
  if (path_within(in, out))
    throw CheckpointError(fmt::format("{}: the output contains the input {}; replacing it would delete the input",
                                      out.string(), in.string()));
  // A link inside the input folder that leads into the output: `quantize inp -o victim --force` with
  // inp/model.safetensors -> ../victim/model.safetensors replaced the only copy of the BF16 weights by
  // LUT-B ones, exit 0 (the checks above compare the folders, not the files read). Every link below
  // the input (files and folders; folders through links are not followed) is resolved; the walk is
  // bounded, as is a checkpoint folder.
  std::error_code ec;
  if (!std::filesystem::is_directory(in, ec) || !std::filesystem::exists(out, ec)) return;
  std::filesystem::recursive_directory_iterator it(in, std::filesystem::directory_options::skip_permission_denied, ec);
  const std::filesystem::recursive_directory_iterator end;
  for (std::size_t seen = 0; !ec && it != end && seen < 100000; it.increment(ec), ++seen) {
    if (it.depth() >= 16) it.disable_recursion_pending();
    std::error_code lec;
    if (!it->is_symlink(lec) || lec) continue;
    if (path_within(it->path(), out))
      throw CheckpointError(fmt::format("{}: the input {} reads {} through a link into the output ({}); replacing the "
                                        "output would delete it; choose another output; nothing written",
                                        out.string(), in.string(), it->path().string(),
                                        resolved_path(it->path()).string()));
  }
}

namespace {
// True when `config` is a regular file (not a link) whose JSON says this tool wrote the directory: a
// LUT-B checkpoint (quantization_config.quant_method "lut_b") or a synth output ("lutb_synthetic").
bool written_by_lutb(const std::filesystem::path& config) {
  std::error_code ec;
  const auto st = std::filesystem::symlink_status(config, ec);
  if (ec || !std::filesystem::is_regular_file(st) || std::filesystem::file_size(config, ec) > (16u << 20) || ec)
    return false;
  std::ifstream f(config, std::ios::binary);
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return false;
  if (j.contains("lutb_synthetic")) return true;
  const auto q = j.find("quantization_config");
  if (q == j.end() || !q->is_object()) return false;
  const auto m = q->find("quant_method");
  return m != q->end() && m->is_string() && m->get<std::string>() == "lut_b";
}
}  // namespace

void check_replaceable(const std::filesystem::path& target, bool want_directory, bool force) {
  std::error_code ec;
  const auto st = std::filesystem::symlink_status(target, ec);
  // A path the file system cannot look up (a name longer than it allows, a loop of links, a parent
  // that cannot be searched) is refused for what it is, before a std::filesystem call reports it as
  // "filesystem error: status: File name too long [OUT]".
  if (ec && st.type() != std::filesystem::file_type::not_found)
    throw CheckpointError(fmt::format("{}: cannot be used as the output: {}{}; nothing written", target.string(),
                                      ec.message(),
                                      ec.value() == ENAMETOOLONG
                                          ? " (a file or folder name may have at most 255 bytes on most file systems)"
                                          : ""));
  if (ec || !std::filesystem::exists(st)) return;
  // An output given as a symbolic link: the output is renamed into place, which would replace the
  // link itself, never what it points to. Say that it is a link and what to give instead, rather than
  // "exists and is not a directory" about a folder that plainly exists.
  if (std::filesystem::is_symlink(st)) {
    const auto to = std::filesystem::read_symlink(target, ec);
    std::error_code rec;
    const auto resolved = std::filesystem::weakly_canonical(std::filesystem::absolute(target), rec);
    const bool dangling = !std::filesystem::exists(std::filesystem::status(target, rec));
    throw CheckpointError(fmt::format(
        "{}: is a symbolic link (to {}{}); lutb does not write through a link (the output is renamed into place, "
        "which would replace the link, not its target): give the target itself as the output{}, or remove the "
        "link; nothing written",
        target.string(), ec ? std::string("?") : to.string(), dangling ? ", which does not exist" : "",
        rec ? std::string() : fmt::format(" ({})", resolved.string())));
  }
  const bool is_dir = std::filesystem::is_directory(st);
  if (want_directory && !is_dir)
    throw CheckpointError(fmt::format(
        "{}: exists and is not a directory; refusing to replace it with a checkpoint directory", target.string()));
  if (!want_directory && is_dir)
    throw CheckpointError(fmt::format("{}: exists and is a directory; refusing to replace it with a file",
                                      target.string()));
  if (!force) {
    // The caller refuses an existing output with "use --force to replace it"; when --force would refuse it
    // too (the current folder, a folder of other files), that advice would lead to a second refusal,
    // so the --force check's reason is given at once.
    try {
      check_replaceable(target, want_directory, /*force=*/true);
    } catch (const CheckpointError& e) {
      std::string why = e.what();
      const std::string head = target.string() + ": ";
      if (why.rfind(head, 0) == 0) why.erase(0, head.size());
      if (const auto p = why.find("; refusing to replace it with --force"); p != std::string::npos) why.erase(p);
      throw CheckpointError(fmt::format("{}: the output exists, and --force would not replace it either: {}{}; choose "
                                        "another output or remove it yourself; nothing written",
                                        target.string(), why.rfind("cannot", 0) == 0 ? "" : "it ", why));
    }
    return;
  }
  // --force deletes the old output, so it may only ever hit something this tool could have written
  // (never any directory d of "-o d --force", the current one or one holding the user's notes).
  std::error_code cec;
  const auto cwd = std::filesystem::current_path(cec);
  if (!cec && path_within(cwd, target))
    throw CheckpointError(fmt::format("{}: is the current directory or one of its ancestors; refusing to replace it "
                                      "with --force; nothing changed",
                                      target.string()));
  if (!is_dir) {
    if (!std::filesystem::is_regular_file(st) || target.extension() != ".safetensors")
      throw CheckpointError(fmt::format("{}: exists and is not a regular .safetensors file; refusing to replace it "
                                        "with --force; nothing changed",
                                        target.string()));
    return;
  }
  // quantize copies every other file of its source (README.md, LICENSE, .gitattributes, subfolders of
  // a Hugging Face repository), so a LUT-B checkpoint this tool wrote is recognised by its config,
  // not by its file names ("--force" refused lutb's own output).
  if (written_by_lutb(target / "config.json")) return;
  for (std::filesystem::directory_iterator it(target, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    const auto est = it->symlink_status();
    std::string why;
    if (std::filesystem::is_directory(est))
      why = "a subdirectory";
    else if (!std::filesystem::is_regular_file(est))
      why = "not a regular file";
    else if (!checkpoint_entry_name(name))
      why = "not a file a checkpoint holds";
    if (!why.empty())
      throw CheckpointError(fmt::format("{}: does not look like a checkpoint this tool wrote ('{}' is {}); refusing to "
                                        "replace it with --force; remove it yourself or choose another output; "
                                        "nothing changed",
                                        target.string(), name, why));
  }
  if (ec)
    throw CheckpointError(fmt::format("{}: cannot list it ({}); refusing to replace it with --force; nothing changed",
                                      target.string(), ec.message()));
}

void sync_directory(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  (void)::fsync(fd);  // best effort: some file systems refuse fsync on a directory
  ::close(fd);
}

void write_text_file(const fs::path& path, const std::string& text) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
  if (fd < 0) throw CheckpointError(fmt::format("{}: cannot create: {}", path.string(), std::strerror(errno)));
  std::string error;
  for (std::size_t done = 0; done < text.size();) {
    const ssize_t w = ::write(fd, text.data() + done, text.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) {
      error = fmt::format("{}: cannot write: {}", path.string(), std::strerror(errno));
      break;
    }
    done += static_cast<std::size_t>(w);
  }
  if (error.empty() && ::fsync(fd) != 0)
    error = fmt::format("{}: cannot write (fsync): {}", path.string(), std::strerror(errno));
  if (::close(fd) != 0 && error.empty())
    error = fmt::format("{}: cannot write: {}", path.string(), std::strerror(errno));
  if (!error.empty()) throw CheckpointError(error);
}

void install_replacing(const fs::path& tmp, const fs::path& target, bool want_directory, bool force) {
  std::error_code ec;
  // The finished output's file names reach the disk before it is renamed into place (its files were
  // fsynced by their writers): after a power cut the destination is the old one or the whole new one.
  if (want_directory) sync_directory(tmp);
  fs::path t = target;
  if (!t.has_filename()) t = t.parent_path();
  if (!fs::exists(fs::symlink_status(t, ec))) {
    // RENAME_NOREPLACE: a target created between the check above and this rename is not replaced.
    if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, t.c_str(), RENAME_NOREPLACE) == 0) return;
    const int err = errno;
    if (err == EINVAL || err == ENOSYS) {  // a file system without RENAME_NOREPLACE: the plain rename
      fs::rename(tmp, t);
      return;
    }
    if (err != EEXIST)
      throw CheckpointError(fmt::format("{}: cannot move the finished output into place: {}; nothing changed",
                                        target.string(), std::strerror(err)));
  }
  // The target exists now. The caller checked it at the start, but it may have appeared since (a
  // second run, the user): never replace it without force, and with force apply the --force rules
  // again to what is there now (a folder created mid-run is not lutb's to delete).
  if (!force)
    throw CheckpointError(fmt::format("{}: appeared while the output was being written; refusing to replace it "
                                      "without --force; the new output was removed and {} is as it was",
                                      target.string(), target.string()));
  check_replaceable(t, want_directory, /*force=*/true);
  const fs::path old = t.parent_path() / (t.filename().string() + ".old." + std::to_string(::getpid()));
  fs::remove_all(old, ec);
  // The old output is moved aside, the new one renamed into place, then the old one removed. A folder
  // where the old output cannot be moved (sticky, owned by another user) is reported with the
  // outcome, not as "filesystem error: cannot rename: ... [out] [out.old.PID]".
  fs::rename(t, old, ec);
  if (ec)
    throw CheckpointError(fmt::format("{}: cannot move the existing output aside to replace it ({} -> {}: {}); the new "
                                      "output was removed and {} is as it was",
                                      target.string(), t.string(), old.string(), ec.message(),
                                      target.string()));
  fs::rename(tmp, t, ec);
  if (ec) {
    const std::string why = ec.message();
    fs::rename(old, t, ec);  // put the old one back
    throw CheckpointError(fmt::format("{}: cannot move the new output into place: {}; the new output was removed and "
                                      "{}",
                                      target.string(), why,
                                      ec ? fmt::format("the old one is at {}", old.string())
                                         : fmt::format("{} is as it was", target.string())));
  }
  // The old output could be renamed but not removed (a folder owned by another user inside it): the
  // message says that OUT.old.PID remains, so that the next run does not take it for the leftover of
  // an interrupted run.
  fs::remove_all(old, ec);
  if (ec || fs::exists(fs::symlink_status(old, ec)))
    fmt::print(stderr, "lutb: warning: {} replaced, but its old contents could not be removed ({}); they are at {}: "
                       "delete them yourself\n",
                       target.string(), ec ? ec.message() : std::string("not all entries removable"), old.string());
}

namespace {
// The reason an output cannot be created. For ENAMETOOLONG on an output whose own name is within
// the file system's limit but whose temporary (NAME.tmp.PID, for a single file NAME.tmp.PID.tmp.PID)
// is not, it names the name that is too long, not only the valid one the user gave.
std::string create_failure(const fs::path& tmp, const fs::path& target, int err) {
  if (err != ENAMETOOLONG) return std::strerror(err);
  const fs::path dir = tmp.has_parent_path() ? tmp.parent_path() : fs::path(".");
  const long limit = ::pathconf(dir.c_str(), _PC_NAME_MAX);
  const std::size_t max = limit > 0 ? static_cast<std::size_t>(limit) : 255;
  const std::size_t len = tmp.filename().string().size(), own = target.filename().string().size();
  if (own > max || len <= max) return std::strerror(err);  // the output's own name, or another component, is too long
  return fmt::format("{}: lutb writes the output under the temporary name {} ({} bytes) and renames it at the end, "
                     "and this file system allows names of at most {} bytes; choose an output name of at most {} "
                     "bytes (this one has {})",
                     std::strerror(err), tmp.filename().string(), len, max, own - std::min(own, len - max), own);
}
}  // namespace

void create_temp_dir(const fs::path& tmp, const fs::path& target) {
  std::error_code ec;
  if (!fs::create_directories(tmp, ec) && ec)
    throw CheckpointError(fmt::format("{}: cannot create the output: {}; nothing written", target.string(),
                                      create_failure(tmp, target, ec.value())));
}

CreatedParents::~CreatedParents() {
  if (!armed) return;
  std::error_code ec;
  for (const auto& d : made) fs::remove(d, ec);  // removes an empty directory only
}

void create_parents(const fs::path& target, CreatedParents& out) {
  fs::path t = target;
  if (!t.has_filename()) t = t.parent_path();
  std::error_code ec;
  std::vector<fs::path> missing;  // deepest first
  for (fs::path p = t.parent_path(); !p.empty() && !fs::exists(fs::symlink_status(p, ec)); p = p.parent_path()) {
    missing.push_back(p);
    if (p == p.parent_path()) break;
  }
  for (auto it = missing.rbegin(); it != missing.rend(); ++it) {
    if (!fs::create_directory(*it, ec) && ec)
      throw CheckpointError(fmt::format("{}: cannot create its parent directory {}: {}; nothing written",
                                        target.string(), it->string(), ec.message()));
    out.made.insert(out.made.begin(), *it);
  }
}

void probe_temp_file(const fs::path& tmp, const fs::path& target) {
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
  if (fd < 0)
    throw CheckpointError(fmt::format("{}: cannot create the output: {}; nothing written", target.string(),
                                      create_failure(tmp, target, errno)));
  ::close(fd);
  ::unlink(tmp.c_str());
}

fs::path temp_sibling(const fs::path& target) {
  fs::path t = target;
  if (!t.has_filename()) t = t.parent_path();
  return t.parent_path() / (t.filename().string() + ".tmp." + std::to_string(::getpid()));
}

fs::path output_path(const fs::path& p) {
  fs::path r = p;
  while (r.has_parent_path() && r.parent_path() != r && (r.filename().empty() || r.filename() == "."))
    r = r.parent_path();
  // "-o new/x/.." is refused at once: what ".." names depends on links and on whether new/x exists,
  // and the final rename would fail after the whole job. The output is named by its own name. A bare ".." stays: the --force rules refuse it as an ancestor of
  // the current folder.
  if (r.filename() == ".." && r.has_parent_path())
    throw CheckpointError(fmt::format("{}: an output path may not end in '..'; give the folder by its own name; "
                                      "nothing written",
                                      p.string()));
  return r;
}

std::string target_left_clause(const fs::path& target) {
  std::error_code ec;
  if (fs::exists(fs::symlink_status(target, ec))) return fmt::format("{} is as it was", target.string());
  return fmt::format("nothing was created at {}", target.string());
}

void check_interrupt(const std::atomic<int>* flag, const fs::path& target) {
  if (!flag) return;
  const int sig = flag->load(std::memory_order_relaxed);
  if (sig == 0) return;
  throw Interrupted(sig, fmt::format("{}: interrupted by signal {} ({}); the partial output was removed and {}",
                                     target.string(), sig, strsignal(sig), target_left_clause(target)));
}

void check_free_space(const fs::path& target, std::uint64_t need, std::string_view what) {
  fs::path probe = target.parent_path().empty() ? fs::path(".") : target.parent_path();
  std::error_code ec;
  while (!fs::exists(probe, ec) && probe.parent_path() != probe)  // the nearest existing ancestor
    probe = probe.parent_path().empty() ? fs::path(".") : probe.parent_path();
  const fs::space_info sp = fs::space(probe, ec);
  // GB, or MB below 1 GB ("needs 0.01 GB but only 0.01 GB are free" read as a contradiction). (TB and PB
  // for absurd sizes: "108113329.17 GB" read as a number to decode.)
  const auto size = [](std::uint64_t b) {
    const double d = static_cast<double>(b);
    if (d >= 1e15) return fmt::format("{:.2f} PB", d / 1e15);
    if (d >= 1e12) return fmt::format("{:.2f} TB", d / 1e12);
    return b >= 1000000000u ? fmt::format("{:.2f} GB", d / 1e9) : fmt::format("{:.2f} MB", d / 1e6);
  };
  if (ec || sp.available >= need) return;
  // Too little space, or a place where nothing can be written at all: /proc and /sys report 0 bytes
  // free, which must not read as "needs more free space". An empty probe directory
  // tells them apart: it is removed at once, and only ENOSPC / EDQUOT (or success) leaves the
  // verdict to the free-space figures.
  const fs::path dir_probe = probe / (".lutb-probe." + std::to_string(::getpid()));
  if (::mkdir(dir_probe.c_str(), 0700) == 0) {
    ::rmdir(dir_probe.c_str());
  } else if (errno != ENOSPC && errno != EDQUOT && errno != EEXIST) {
    const int err = errno;
    throw CheckpointError(fmt::format("{}: nothing can be created in {}: {}{}; nothing written", target.string(),
                                      probe.string(), std::strerror(err),
                                      err == EROFS ? "" : " (a read-only, virtual or protected filesystem?)"));
  }
  throw CheckpointError(fmt::format("{}: {} needs {} ({} bytes) but only {} ({} bytes) are free on the filesystem "
                                    "of {}; nothing written",
                                    target.string(), what, size(need), need, size(sp.available), sp.available,
                                    probe.string()));
}

void copy_file_contents(const fs::path& from, const fs::path& to, const std::atomic<int>* stop,
                        const fs::path& target) {
  const int in = ::open(from.c_str(), O_RDONLY | O_CLOEXEC);
  if (in < 0) throw CheckpointError(fmt::format("{}: cannot open: {}", from.string(), std::strerror(errno)));
  const int out = ::open(to.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
  if (out < 0) {
    const int err = errno;
    ::close(in);
    throw CheckpointError(fmt::format("{}: cannot create: {}", to.string(), std::strerror(err)));
  }
  std::vector<char> buf(1 << 20);
  std::string error;
  int sig = 0;
  for (;;) {
    if (stop && (sig = stop->load(std::memory_order_relaxed)) != 0) break;
    const ssize_t n = ::read(in, buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      error = fmt::format("{}: cannot read: {}", from.string(), std::strerror(errno));
      break;
    }
    if (n == 0) break;
    for (ssize_t done = 0; done < n;) {
      const ssize_t w = ::write(out, buf.data() + done, static_cast<std::size_t>(n - done));
      if (w < 0 && errno == EINTR) continue;
      if (w < 0) {
        error = fmt::format("{}: cannot write: {}", to.string(), std::strerror(errno));
        break;
      }
      done += w;
    }
    if (!error.empty()) break;
  }
  ::close(in);
  // The copy reaches the disk before the output folder is renamed into place, as the safetensors
  // files do: after a power cut a finished checkpoint never holds empty copies.
  if (error.empty() && sig == 0 && ::fsync(out) != 0)
    error = fmt::format("{}: cannot write (fsync): {}", to.string(), std::strerror(errno));
  if (::close(out) != 0 && error.empty()) error = fmt::format("{}: cannot write: {}", to.string(), std::strerror(errno));
  if (sig != 0)
    throw Interrupted(sig, fmt::format("{}: interrupted by signal {} ({}) while copying {}; the partial output was "
                                       "removed and {}",
                                       target.string(), sig, strsignal(sig), from.string(), target_left_clause(target)));
  if (!error.empty()) throw CheckpointError(error);
}

}  // namespace detail

std::vector<fs::path> stale_temporaries(const fs::path& target_arg) {
  fs::path target = target_arg;
  if (!target.has_filename()) target = target.parent_path();
  const fs::path dir = target.parent_path().empty() ? fs::path(".") : target.parent_path();
  const std::string base = target.filename().string();
  std::vector<fs::path> found;
  if (base.empty()) return found;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.size() <= base.size() + 5 || name.compare(0, base.size(), base) != 0) continue;
    const std::string rest = name.substr(base.size());  // ".tmp.<pid>..." or ".old.<pid>..."
    if (rest.compare(0, 5, ".tmp.") != 0 && rest.compare(0, 5, ".old.") != 0) continue;
    std::size_t i = 5;
    while (i < rest.size() && rest[i] >= '0' && rest[i] <= '9') ++i;
    if (i == 5 || i - 5 > 9 || (i < rest.size() && rest[i] != '.')) continue;  // "<pid>" then end or '.'
    const long pid = std::stol(rest.substr(5, i - 5));
    if (pid <= 0) continue;
    if (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;  // running (or not ours to probe)
    found.push_back(target.parent_path() / name);
  }
  std::sort(found.begin(), found.end());
  return found;
}

std::uint64_t peak_rss_bytes() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("VmHWM:", 0) == 0) {
      std::istringstream is(line.substr(6));
      std::uint64_t kb = 0;
      is >> kb;
      return kb * 1024;
    }
  }
  return 0;
}

std::string low_sqnr_warning(const std::string& where, double sse, double sum_sq, std::int64_t weights,
                             const std::string& method) {
  if (!(sum_sq > 0) || !(sse >= 0.5 * sum_sq)) return {};
  const double sqnr = 10.0 * std::log10(sum_sq / sse);
  std::string w = fmt::format("{}: SQNR {:.2f} dB with {}: the quantised tensor kept less than half of the weights' "
                              "energy (typical fits keep 13-15 dB)",
                              where, sqnr, method);
  if (method == "ct-lloyd" || method == "multistart") {
    const double rms = weights > 0 ? std::sqrt(sum_sq / static_cast<double>(weights)) : 0.0;
    w += fmt::format("; {} fits no tile scale (scale byte 127, spec 2.1), so its codebook holds only magnitudes "
                     "2^-9..448 and weights far outside them are lost (this tensor's RMS is {:.3g}); the scaled "
                     "fitters binned-dp (the default) and optimal fit them",
                     method, rms);
  }
  return w;
}

std::string format_summary(const QuantizeSummary& s) {
  auto mb = [](std::uint64_t b) { return static_cast<double>(b) / 1e6; };
  const double sqnr = s.stats.sqnr_db();
  std::string out;
  out += fmt::format("fitter               {}\n", s.fitter);
  out += fmt::format("tensors quantised    {} ({} weights, {} tiles)\n", s.tensors_quantized, s.weights, s.stats.tiles);
  out += fmt::format("tensors copied       {}\n", s.tensors_copied);
  out += fmt::format("quantised bytes      {:.2f} MB -> {:.2f} MB ({:.2f}x smaller)\n", mb(s.bytes_before), mb(s.bytes_after),
                     s.bytes_after ? static_cast<double>(s.bytes_before) / static_cast<double>(s.bytes_after) : 0.0);
  out += fmt::format("bits per weight      {:.4f}\n", s.bits_per_weight());
  out += fmt::format("all tensors          {:.2f} MB -> {:.2f} MB\n", mb(s.input_bytes), mb(s.output_bytes));
  out += std::isinf(sqnr) ? std::string("aggregate SQNR       inf dB (exact)\n")
                          : fmt::format("aggregate SQNR       {:.2f} dB\n", sqnr);
  out += fmt::format("time                 {:.2f} s\n", s.seconds);
  out += fmt::format("peak RSS             {:.1f} MB\n", mb(s.peak_rss_bytes));
  // Each file with its own reason, files of one reason together (not every reason lutb has after
  // every file).
  if (!s.skipped_files.empty()) {
    std::vector<std::pair<std::string, std::vector<std::string>>> by_reason;
    for (const auto& f : s.skipped_files) {
      const std::string why = detail::skipped_file_reason(f);
      auto it = std::find_if(by_reason.begin(), by_reason.end(), [&](const auto& r) { return r.first == why; });
      if (it == by_reason.end()) it = by_reason.insert(by_reason.end(), {why, {}});
      it->second.push_back(f);
    }
    std::string line;
    for (const auto& [why, files] : by_reason)
      line += fmt::format("{}{} ({})", line.empty() ? "" : "; ", fmt::join(files, ", "), why);
    out += fmt::format("not copied           {}\n", line);
  }
  return out;
}

}  // namespace lutb
