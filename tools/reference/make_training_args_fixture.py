# Writes tests/data/config/training_args.json: a Hugging Face TrainingArguments dump
# (to_json_string(), every field) of a short CPU run that accel-train's --training-args test
# trains from. Run it where transformers 5.x (and torch) are installed, from the repository root:
#
#   python3 tools/reference/make_training_args_fixture.py [-o tests/data/config/training_args.json]
#
# The committed file was first written by hand from transformers 5.x's field list; running this
# replaces it with what transformers itself dumps (tests/runtime/training_args_test.cpp and
# tests/tools/accel_train_test.cpp read it).
import argparse

from transformers import TrainingArguments

p = argparse.ArgumentParser()
p.add_argument("-o", "--output", default="tests/data/config/training_args.json")
a = p.parse_args()

args = TrainingArguments(
    output_dir="out/trainer-args",
    use_cpu=True,
    max_steps=30,
    per_device_train_batch_size=4,
    per_device_eval_batch_size=4,
    gradient_accumulation_steps=2,
    learning_rate=1e-3,
    lr_scheduler_type="cosine",
    warmup_steps=0.1,
    weight_decay=0.01,
    adam_beta2=0.95,
    max_grad_norm=1.0,
    logging_steps=5,
    eval_strategy="steps",
    eval_steps=10,
    save_steps=10,
    save_total_limit=2,
    seed=1234,
    report_to=["tensorboard"],
)
with open(a.output, "w") as f:
    f.write(args.to_json_string() + "\n")
print("wrote", a.output)
