"""Checks of the tree's structure that review would otherwise have to catch (ctest runs
them, label unit):

  includes   server/ and client/ include no engine header but engine/engine.h and
             engine/common/*.h: the engine's internals stay behind its public header.
  functions  no function in engine/job/, engine/pipeline/ or server/job_runner.cc runs
             longer than 120 lines: the step, the trainer's setup and a running job are
             named stages, not god functions.

Usage: python3 check_structure.py ROOT [includes|functions]...   (all checks by default)
"""

import os
import re
import sys

INCLUDE = re.compile(r'^\s*#\s*include\s+"(engine/[^"]+)"')
MAX_FUNCTION_LINES = 120


def sources(root, folder, exts=(".cc", ".h", ".cu", ".cuh")):
    for dirpath, _, files in os.walk(os.path.join(root, folder)):
        for name in sorted(files):
            if name.endswith(exts):
                yield os.path.join(dirpath, name)


def check_includes(root):
    bad = []
    for folder in ("server", "client"):
        for path in sources(root, folder):
            with open(path, encoding="utf-8") as f:
                for number, line in enumerate(f, 1):
                    m = INCLUDE.match(line)
                    if m and m.group(1) != "engine/engine.h" and \
                            not m.group(1).startswith("engine/common/"):
                        bad.append(f"{os.path.relpath(path, root)}:{number}: includes "
                                   f"{m.group(1)}; include engine/engine.h instead")
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
    paths = list(sources(root, "engine/job", (".cc",))) + \
        list(sources(root, "engine/pipeline", (".cc",))) + \
        [os.path.join(root, "server", "job_runner.cc")]
    for path in paths:
        for line, name, length in long_functions(path):
            bad.append(f"{os.path.relpath(path, root)}:{line}: {name} is {length} lines "
                       f"(at most {MAX_FUNCTION_LINES}); split it into named stages")
    return bad


def main():
    root = sys.argv[1]
    checks = sys.argv[2:] or ["includes", "functions"]
    problems = []
    for check in checks:
        problems += {"includes": check_includes, "functions": check_functions}[check](root)
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
