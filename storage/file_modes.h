// FileModes: the modes of what the file tier creates, whatever the umask: directories 0700,
// objects 0600. A cached KV page is the prompt in another form; only the daemon's user reads it.
// Daemons sharing a directory (`shared`) run as one user (docs/storage.md "Permissions").
// Directories that exist already keep their mode (an operator's choice).
//
// A umask only ever narrows a mode, and the usual ones (022, 027, 077) leave the owner's bits:
// then the mode given at creation is the mode, and nothing more is done. Where the umask takes
// owner bits away, or cannot be read, each directory and object is chmod-ed after it is created.
//
// Threads: immutable after construction; any thread.
#ifndef KVCELLAR_STORAGE_FILE_MODES_H_
#define KVCELLAR_STORAGE_FILE_MODES_H_

#include <sys/types.h>

#include <optional>

namespace kvcellar::storage {

class FileModes {
 public:
  static constexpr mode_t kDirMode = 0700;
  static constexpr mode_t kObjectMode = 0600;

  // For this process's umask (read without changing it).
  static FileModes ForProcessUmask();
  // For a umask; nullopt: unknown.
  static FileModes ForUmask(std::optional<mode_t> umask);

  // mkdirat with kDirMode exactly. Returns mkdirat's result, errno with it.
  int MakeDir(int dirfd, const char* path) const;
  // Gives a just-created object kObjectMode where the umask took bits of it.
  void FixObject(int fd) const;

  bool chmod_after_create() const { return chmod_after_create_; }

 private:
  explicit FileModes(bool chmod_after_create) : chmod_after_create_(chmod_after_create) {}

  bool chmod_after_create_;
};

// The process umask, read without changing it (umask(2) reads only by setting, which races with
// other threads creating files): the "Umask:" line of /proc/self/status (Linux 4.7+). nullopt
// where that is missing.
std::optional<mode_t> ReadProcessUmask();

}  // namespace kvcellar::storage

#endif  // KVCELLAR_STORAGE_FILE_MODES_H_
