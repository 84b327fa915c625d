"""Checks of the tree's structure that review would otherwise have to catch (ctest runs
them, label unit):

  includes   server/ and client/ include no engine header but engine/engine.h and
             engine/common/*.h: the engine's internals stay behind its public header. And
             neither includes the other: what both ends of the API share is in rpc/, which
             includes neither.
  functions  no function in a .cc or .h of engine/ or server/ runs longer than 100 lines
             (CUDA kernels, .cu and .cuh, aside): the step, the planner, a tokenizer's load
             and the daemon are named stages, not god functions.
  floors     engine/'s folders stand on floors (FLOORS, lowest first), and a folder includes
             only its own headers and those of floors below it: the dependency arrows of
             the diagram point one way. engine/engine.h, the API's value types, is no floor.
  getenv     nothing below main reads the environment: getenv appears in engine/, server/,
             client/, rpc/ and bench/ only in a file that defines main(), which hands what it
             read down as options (engine/common/engine_settings.h for the engine). Tests
             are not checked: they may read their own harness's variables.

Usage: python3 check_structure.py ROOT [includes|functions|floors|getenv]...   (all by default)
"""

import os
import re
import sys

INCLUDE = re.compile(r'^\s*#\s*include\s+"(engine/[^"]+)"')
MAX_FUNCTION_LINES = 100

# engine/'s folders, floor by floor from the bottom (derived from the includes): a folder
# may include its own and lower floors' headers, never a sibling's on its floor or above.
FLOORS = [
    ["common"],
    ["kernels", "model", "data"],
    ["backend", "store", "layers"],
    ["transfer", "checkpoint"],
    ["optim"],
    ["plan"],
    ["pipeline", "generate"],
    ["job"],
    ["tools"],
]
ENGINE_INCLUDE = re.compile(r'^\s*#\s*include\s+"engine/([^/"]+)/')
ANY_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^/"]+)/')
GETENV = re.compile(r"\b(?:secure_)?getenv\b")
DEFINES_MAIN = re.compile(r"\bint\s+main\s*\(")


def sources(root, folder, exts=(".cc", ".h", ".cu", ".cuh")):
    for dirpath, _, files in os.walk(os.path.join(root, folder)):
        for name in sorted(files):
            if name.endswith(exts):
                yield os.path.join(dirpath, name)


def check_includes(root):
    bad = []
    for side in ("server", "client", "rpc"):
        for path in sources(root, side):
            with open(path, encoding="utf-8") as f:
                for number, line in enumerate(f, 1):
                    where = f"{os.path.relpath(path, root)}:{number}"
                    engine = INCLUDE.match(line)
                    if engine and side == "rpc":
                        bad.append(f"{where}: includes {engine.group(1)}; rpc/ stands alone")
                    elif engine and engine.group(1) != "engine/engine.h" and \
                            not engine.group(1).startswith("engine/common/"):
                        bad.append(f"{where}: includes {engine.group(1)}; include "
                                   "engine/engine.h instead")
                    other = ANY_INCLUDE.match(line)
                    allowed = {side} if side == "rpc" else {side, "rpc"}
                    if other and other.group(1) in ("server", "client", "rpc") and \
                            other.group(1) not in allowed:
                        bad.append(f"{where}: {side}/ includes {other.group(1)}/; what both "
                                   "ends of the API share belongs in rpc/")
    return bad


def strip_comments_and_strings(text):
    """The text with comments, string and char literals blanked (newlines kept)."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append("\n" * text.count("\n", i, j))
            i = j
        elif text.startswith('R"', i):
            m = re.match(r'R"([^(]*)\(', text[i:])
            end = text.find(")" + m.group(1) + '"', i) if m else -1
            j = n if end < 0 else end + len(m.group(1)) + 2
            out.append("\n" * text.count("\n", i, j))
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            out.append(" ")
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


# A function definition's head: a name and its parameter list, then (optionally const,
# override, noexcept, an initializer list...) an opening brace; not a control statement.
HEAD = re.compile(r"([A-Za-z_~][\w:~<>]*)\s*\([^;{}]*\)\s*(?:const|override|final|noexcept|"
                  r"->\s*[\w:<>,\s*&]+|:\s*[^;{}]*?)*\s*\{$")
NOT_FUNCTIONS = {"if", "for", "while", "switch", "catch", "return", "sizeof", "do"}


def long_functions(path):
    with open(path, encoding="utf-8") as f:
        text = strip_comments_and_strings(f.read())
    lines = text.split("\n")
    found = []
    depth = 0
    start = None  # (line index, name, depth at which it opened)
    pending = ""
    for index, line in enumerate(lines):
        for pos, ch in enumerate(line):
            if ch == "{":
                head = (pending + line[:pos + 1]).strip()
                m = HEAD.search(head[-400:])
                if start is None and m and m.group(1).split("::")[-1] not in NOT_FUNCTIONS:
                    start = (index, m.group(1), depth)
                depth += 1
                pending = ""
            elif ch == "}":
                depth -= 1
                if start is not None and depth == start[2]:
                    length = index - start[0] + 1
                    if length > MAX_FUNCTION_LINES:
                        found.append((start[0] + 1, start[1], length))
                    start = None
                pending = ""
            elif ch == ";":
                pending = ""
        pending += line + " "
    return found


def check_functions(root):
    bad = []
    paths = list(sources(root, "engine", (".cc", ".h"))) + \
        list(sources(root, "server", (".cc", ".h")))
    for path in paths:
        for line, name, length in long_functions(path):
            bad.append(f"{os.path.relpath(path, root)}:{line}: {name} is {length} lines "
                       f"(at most {MAX_FUNCTION_LINES}); split it into named stages")
    return bad


def check_floors(root):
    floor_of = {folder: i for i, floor in enumerate(FLOORS) for folder in floor}
    bad = []
    engine = os.path.join(root, "engine")
    for folder in sorted(os.listdir(engine)):
        if not os.path.isdir(os.path.join(engine, folder)):
            continue
        if folder not in floor_of:
            bad.append(f"engine/{folder}/ stands on no floor: add it to FLOORS in "
                       f"{os.path.relpath(__file__, root)}")
            continue
        for path in sources(root, os.path.join("engine", folder)):
            with open(path, encoding="utf-8") as f:
                for number, line in enumerate(f, 1):
                    m = ENGINE_INCLUDE.match(line)
                    if not m or m.group(1) == folder:
                        continue
                    included = m.group(1)
                    if included not in floor_of or floor_of[included] >= floor_of[folder]:
                        bad.append(f"{os.path.relpath(path, root)}:{number}: engine/{folder}/ "
                                   f"includes engine/{included}/, which is not on a floor "
                                   f"below it; move what both need below {folder}/")
    return bad


def check_getenv(root):
    bad = []
    for folder in ("engine", "server", "client", "rpc", "bench"):
        for path in sources(root, folder):
            with open(path, encoding="utf-8") as f:
                text = strip_comments_and_strings(f.read())
            if DEFINES_MAIN.search(text):
                continue
            for number, line in enumerate(text.split("\n"), 1):
                if GETENV.search(line):
                    bad.append(f"{os.path.relpath(path, root)}:{number}: reads the "
                               "environment below main; read it in main() and pass it down "
                               "(an option, or EngineSettings)")
    return bad


CHECKS = {"includes": check_includes, "functions": check_functions, "floors": check_floors,
          "getenv": check_getenv}


def main():
    root = sys.argv[1]
    checks = sys.argv[2:] or list(CHECKS)
    problems = []
    for check in checks:
        problems += CHECKS[check](root)
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
