// The data pipeline's public interface, for the trainer and the tools:
//   loader.h     DataOptions -> BatchSource (shards, text, synthetic), DataPosition for checkpoints
//   corpus.h     text files -> token shards (accel-data; cached for data.source text)
//   tokenizer.h  byte-level and Hugging Face byte-level BPE tokenizers
//   shard.h      the token shard format: writer and memory-mapped reader
#pragma once

#include "runtime/data/corpus.h"
#include "runtime/data/loader.h"
#include "runtime/data/shard.h"
#include "runtime/data/tokenizer.h"
