// Printable(): file content quoted in an error message is valid UTF-8 with no control bytes.
#include "engine/common/printable.h"

#include "gtest/gtest.h"

namespace megatrain {
namespace {

TEST(Printable, ValidUtf8TextPassesUnchanged) {
  EXPECT_EQ(Printable("plain ASCII, with 'quotes' and \\backslash"),
            "plain ASCII, with 'quotes' and \\backslash");
  EXPECT_EQ(Printable("caf\xc3\xa9 \xe4\xb8\xad\xe6\x96\x87 \xf0\x9f\x99\x82"),
            "caf\xc3\xa9 \xe4\xb8\xad\xe6\x96\x87 \xf0\x9f\x99\x82");
}

TEST(Printable, ControlCharactersAreEscaped) {
  EXPECT_EQ(Printable("a\nb\tc\rd"), "a\\nb\\tc\\rd");
  constexpr char kControls[] = "nul\0bell\a\x1b[31m\x7f";
  EXPECT_EQ(Printable(std::string(kControls, sizeof(kControls) - 1)),
            "nul\\x00bell\\x07\\x1b[31m\\x7f");
}

TEST(Printable, BytesOutsideValidUtf8SequencesAreEscapedOneByOne) {
  EXPECT_EQ(Printable("last read: '\xff'"), "last read: '\\xff'");
  EXPECT_EQ(Printable("\xc3"), "\\xc3");                  // truncated sequence
  EXPECT_EQ(Printable("\xc3(x"), "\\xc3(x");              // bad continuation
  EXPECT_EQ(Printable("\xc0\xaf"), "\\xc0\\xaf");         // overlong '/'
  EXPECT_EQ(Printable("\xed\xa0\x80"), "\\xed\\xa0\\x80");  // a UTF-16 surrogate
  EXPECT_EQ(Printable("\xf4\x90\x80\x80"), "\\xf4\\x90\\x80\\x80");  // past U+10FFFF
  EXPECT_EQ(Printable("\x80\xc3\xa9"), "\\x80\xc3\xa9");  // a stray continuation, then é
}

}  // namespace
}  // namespace megatrain
