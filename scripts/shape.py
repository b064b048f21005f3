#!/usr/bin/env python3
"""The shape of the production code, in the figures the structure's rules use:
files over 800 lines (before their unit tests), functions over 80 lines,
`Result<_, String>` and comments that cite issues or reviews instead of a
reason. Reads the source as text; runs nothing.

Usage: scripts/shape.py [--all]   (--all lists every long file and function)
"""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The crates that ship in relay's binary; the bench, soak, example provider
# and test kit are tools around it.
PRODUCTION = [
    "services/relay/src",
    "services/relay-cli/src",
    "shared/relay-core/src",
    "shared/relay-store/src",
    "shared/relay-registry/src",
    "shared/relay-kafka-raw/src",
    "shared/relay-budget/src",
]
# The configuration's schema is one coherent list of types and may be long.
LONG_FILES_ALLOWED = {"shared/relay-core/src/config.rs"}
FILE_LIMIT = 800
FUNCTION_LIMIT = 80


def blank_strings_and_comments(text: str) -> str:
    """The text with string, char and comment contents replaced by spaces
    (newlines kept), so braces inside them are not counted."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif (m := re.match(r'b?r(#*)"', text[i:i + 40])) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            end = '"' + m.group(1)
            j = text.find(end, i + m.end())
            j = n if j < 0 else j + len(end)
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            j += 1
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == "'" and (m := re.match(r"'(\\.[^']*|[^\\'])'", text[i:i + 12])):
            out.append(" " * m.end())
            i += m.end()
        else:
            out.append(c)
            i += 1
    return "".join(out)


def production_part(lines):
    """The lines before the file's unit tests (`#[cfg(test)]` then `mod`)."""
    for k, line in enumerate(lines):
        if line.startswith("#[cfg(") and "test" in line and k + 1 < len(lines) and lines[k + 1].lstrip().startswith("mod "):
            return lines[:k]
    return lines


FN = re.compile(r"^\s*(pub(\([^)]*\))?\s+)?(const\s+)?(async\s+)?(unsafe\s+)?fn\s+(\w+)")


def functions(code_lines):
    """(name, first line, length) of every function with a body."""
    found = []
    for k, line in enumerate(code_lines):
        m = FN.match(line)
        if not m:
            continue
        depth, started = 0, False
        for j in range(k, len(code_lines)):
            for ch in code_lines[j]:
                if ch == "{":
                    depth, started = depth + 1, True
                elif ch == "}":
                    depth -= 1
                elif ch == ";" and not started and depth == 0:
                    break
            else:
                if started and depth == 0:
                    found.append((m.group(6), k + 1, j - k + 1))
                    break
                continue
            break
    return found


def test_only(path: Path) -> bool:
    """Whether `path` is a module its parent declares under `#[cfg(test)]`
    (a model or a test kit kept beside the code it checks)."""
    name = path.stem
    parents = [path.parent.with_suffix(".rs"), path.parent / "mod.rs", path.parent / "lib.rs"]
    for parent in parents:
        if parent.exists() and re.search(r"#\[cfg\(test\)\]\s*(pub(\([a-z]+\))? )?mod " + name + ";", parent.read_text()):
            return True
    return False


def main():
    show_all = "--all" in sys.argv
    long_files, long_fns, string_errors, citations = [], [], 0, 0
    for base in PRODUCTION:
        for path in sorted((ROOT / base).rglob("*.rs")):
            rel = str(path.relative_to(ROOT))
            if test_only(path):
                continue
            text = path.read_text()
            lines = production_part(text.split("\n"))
            if len(lines) > FILE_LIMIT and rel not in LONG_FILES_ALLOWED:
                long_files.append((len(lines), rel))
            code = blank_strings_and_comments("\n".join(lines)).split("\n")
            for name, at, length in functions(code):
                if length > FUNCTION_LIMIT:
                    long_fns.append((length, f"{rel}:{at}", name))
            prod = "\n".join(lines)
            string_errors += len(re.findall(r"Result<[^;{]*, String>", prod))
            citations += sum(
                1 for line in lines
                if line.lstrip().startswith("//")
                and re.search(r"(?<!librdkafka )issue \d+|\b[Rr]eview\b|\([DHMLN]\d+\)", line)
            )
    print(f"files over {FILE_LIMIT} lines (before unit tests, config schema excepted): {len(long_files)}")
    for n, rel in sorted(long_files, reverse=True):
        print(f"  {n:5} {rel}")
    print(f"functions over {FUNCTION_LIMIT} lines: {len(long_fns)}")
    for n, at, name in sorted(long_fns, reverse=True)[: None if show_all else 12]:
        print(f"  {n:5} {at} {name}")
    print(f"Result<_, String>: {string_errors}")
    print(f"comment lines citing an issue or review: {citations}")


if __name__ == "__main__":
    main()
