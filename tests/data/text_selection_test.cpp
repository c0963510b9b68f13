// Binary files and duplicates among text inputs (issue 23): accel-data and data.text_files skip
// them with one warning line per kind (docs/data.md), as in a glob over fortune's folder with
// its .dat index files and .u8 symlinks.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <string>

#include "runtime/data/corpus.h"
#include "tests/data/test_util.h"

namespace accel {
namespace {

using testing::TempDir;
using testing::write_bytes;

// A folder like /usr/share/games/fortunes: texts, binary .dat indexes, .u8 symlinks, and a copy.
struct FortuneLike {
  TempDir dir;
  FortuneLike() {
    std::string text;
    for (int i = 0; i < 100; ++i)
      text += "Fortune " + std::to_string(i) + ": caf\xc3\xa9 is well.\n%\n";
    write_bytes(dir.file("art"), text);
    write_bytes(dir.file("art.dat"), std::string("\0\0\0\2\0\0\1\xd1", 8) + "%");
    std::filesystem::create_symlink("art", dir.file("art.u8"));
    write_bytes(dir.file("wisdom"), "Be kind.\n%\n" + text);
    write_bytes(dir.file("wisdom.copy"), "Be kind.\n%\n" + text);
    // Latin-1, not UTF-8: binary as far as a UTF-8 tokenizer is concerned.
    write_bytes(dir.file("latin1"), "caf\xe9 au lait\n");
  }
};

TEST(SelectTextFiles, SkipsBinaryFilesAndExactDuplicatesWithOneNoticeEach) {
  FortuneLike f;
  const auto& d = f.dir;
  TextFileSelection s =
      select_text_files({d.file("art"), d.file("art.dat"), d.file("art.u8"), d.file("latin1"),
                         d.file("wisdom"), d.file("wisdom.copy")},
                        "data.text_files");
  EXPECT_EQ(s.files, (std::vector<std::string>{d.file("art"), d.file("wisdom")}));
  ASSERT_EQ(s.notices.size(), 2u);
  EXPECT_NE(s.notices[0].find("data.text_files: skipped 2 binary file(s) (" + d.file("art.dat") +
                              ", " + d.file("latin1") + ")"),
            std::string::npos)
      << s.notices[0];
  EXPECT_NE(s.notices[0].find("NUL byte at offset 0"), std::string::npos) << s.notices[0];
  EXPECT_NE(s.notices[1].find("skipped 2 duplicate file(s) (" + d.file("art.u8") + ", " +
                              d.file("wisdom.copy") + ")"),
            std::string::npos)
      << s.notices[1];
}

TEST(SelectTextFiles, ASequenceCutAtTheEndOfTheFirstKibIsText) {
  TempDir d;
  // "é" (2 bytes) straddles the 1 KiB window; the file is still text.
  write_bytes(d.file("t"), std::string(1023, 'a') + "\xc3\xa9 and more");
  EXPECT_EQ(select_text_files({d.file("t")}, "x").files.size(), 1u);
}

TEST(SelectTextFiles, NothingLeftIsAnError) {
  TempDir d;
  write_bytes(d.file("a.dat"), std::string("\0\1", 2));
  try {
    select_text_files({d.file("a.dat")}, "accel-data");
    FAIL() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("no text file"), std::string::npos) << e.what();
  }
}

TEST(SelectTextFiles, AccelDataWarnsOnceAndTokenizesOnlyTheTexts) {
  FortuneLike f;
  const std::string cmd = std::string(ACCEL_BIN_DIR) + "/accel-data --tokenizer byte --out " +
                          f.dir.file("out") + " '" + f.dir.file("*") + "' 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  ASSERT_TRUE(p);
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  const int status = pclose(p);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << out;
  EXPECT_NE(out.find("accel-data: warning: FILES: skipped 2 binary file(s)"), std::string::npos)
      << out;
  EXPECT_NE(out.find("accel-data: warning: FILES: skipped 2 duplicate file(s)"), std::string::npos)
      << out;
  EXPECT_EQ(out.find("art.dat "), std::string::npos) << out;  // not in the per-file token list
}

}  // namespace
}  // namespace accel
