#!/usr/bin/env bash
# Repository checks that need no build; ctest runs them (tests/CMakeLists.txt):
#   tools/check_repo.sh self-contained   nothing refers to files outside the repository: the
#                                        fixture generator, the PyTorch references and the
#                                        algorithm notes live here (issue 19)
#   tools/check_repo.sh python           every Python file under tools/ and tests/ parses
#                                        (exit 77, a skip, without python3)
set -euo pipefail
cd "$(dirname "$0")/.."

# Paths of a sibling folder the project once kept next to the repository.
pattern='\.\./shared|shared/(reference|bench|hooks)|(DESIGN|STYLE|ALGORITHMS)\.md'

files() {  # tracked files, or every file where this is no git checkout
  if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    git ls-files -- "$@"
  else
    find "$@" -type f -not -path './build*' -not -path '*/.git/*' 2>/dev/null
  fi
}

case "${1:-}" in
  self-contained)
    hits=$(files . | tr '\n' '\0' | xargs -0 grep -n -I -E "$pattern" -- 2>/dev/null || true)
    if [ -n "$hits" ]; then
      echo "references to files outside the repository (point at the in-repo file instead:"
      echo "tools/reference/, docs/algorithms.md, docs/design.md):"
      echo "$hits"
      exit 1
    fi
    echo "self-contained: no references outside the repository"
    ;;
  python)
    if ! command -v python3 >/dev/null; then
      echo "python3 not found: the Python syntax check is skipped"
      exit 77
    fi
    mapfile -t py < <(files tools tests | grep '\.py$')
    # ast.parse writes nothing (py_compile would leave __pycache__ in the source tree).
    python3 -c 'import ast, sys
for f in sys.argv[1:]:
    with open(f) as fh:
        ast.parse(fh.read(), f)
print(f"python: {len(sys.argv) - 1} files parse")' "${py[@]}"
    ;;
  *)
    echo "usage: tools/check_repo.sh self-contained|python" >&2
    exit 2
    ;;
esac
