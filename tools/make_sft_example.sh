#!/usr/bin/env bash
# A small real fine-tuning set from Debian's `fortunes` package (BSD license, see
# /usr/share/doc/fortunes/copyright), made without downloads: each fortune of a few topics becomes
#   OUT/fortunes_pc.jsonl    {"prompt": "Tell me a fortune about love.\n", "completion": "..."}
#   OUT/fortunes_chat.jsonl  {"messages": [{"role": "user", ...}, {"role": "assistant", ...}]}
# configs/sft-tiny.yaml trains on the first. Usage: tools/make_sft_example.sh [OUT] (default
# build/sft). Only fortunes of at most 216 bytes are used, so that a sample fits the config's
# seq_len of 256 byte tokens (the count left out is printed). Control characters other than
# newline and tab (overstrike backspaces in a few fortunes) are removed; the rest is kept as is.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-build/sft}"
src=/usr/share/games/fortunes
mkdir -p "$out"
topics=(love science computers work education law politics people wisdom literature)
for t in "${topics[@]}"; do
  [ -f "$src/$t" ] || { echo "make_sft_example: $src/$t is missing (install the fortunes package)" >&2; exit 1; }
done
to_jsonl() {  # $1 = pc | chat; reads topic files, writes JSONL
  for t in "${topics[@]}"; do
    LC_ALL=C awk -v topic="$t" -v kind="$1" -v counts="$out/.long" '
      function esc(s) {
        gsub(/[\001-\010\013-\037\177]/, "", s)
        gsub(/\\/, "\\\\\\\\", s); gsub(/"/, "\\\"", s); gsub(/\t/, "\\t", s); gsub(/\n/, "\\n", s)
        return s
      }
      BEGIN { RS = "\n%\n" }
      {
        sub(/\n%?\n*$/, "")
        if ($0 !~ /[^ \t\n]/) next
        if (length($0) > 216) { long++; next }
        q = "Tell me a fortune about " topic "."
        if (kind == "pc")
          printf "{\"prompt\": \"%s\\n\", \"completion\": \"%s\\n\"}\n", esc(q), esc($0)
        else
          printf "{\"messages\": [{\"role\": \"user\", \"content\": \"%s\"}, {\"role\": \"assistant\", \"content\": \"%s\"}]}\n", esc(q), esc($0)
      }
      END { print long + 0 >> counts }' "$src/$t"
  done
}
rm -f "$out/.long"
to_jsonl pc > "$out/fortunes_pc.jsonl"
long=$(awk '{ n += $1 } END { print n + 0 }' "$out/.long")
rm -f "$out/.long"
to_jsonl chat > "$out/fortunes_chat.jsonl"
rm -f "$out/.long"
echo "make_sft_example: $(wc -l < "$out/fortunes_pc.jsonl") samples in $out/fortunes_pc.jsonl and" \
  "$out/fortunes_chat.jsonl ($long fortunes longer than 216 bytes left out)"
