"""Prune a hub model with a recipe, the paper's protocol (needs the Hugging Face hub and
a GPU for a 7B model): 128 x 4096 WikiText-2 training tokens, WikiText-2 test perplexity.

    python examples/prune_with_recipe.py meta-llama/Llama-2-7b-hf recipes/whisper_2of4.yaml
"""

import sys

import torch
from llmcompressor import oneshot
from transformers import AutoModelForCausalLM, AutoTokenizer

import whisper_modifiers  # noqa: F401  (registers the modifiers by name)
from whisper_modifiers.data import calibration_dataset, load_corpus
from whisper_modifiers.evaluation import perplexity, wikitext2_test_text

model_id, recipe = sys.argv[1], sys.argv[2]
tokenizer = AutoTokenizer.from_pretrained(model_id)
model = AutoModelForCausalLM.from_pretrained(model_id, dtype=torch.bfloat16, device_map="auto")
calibration = calibration_dataset(tokenizer, load_corpus("wikitext2"), 128, 4096, seed=0)
oneshot(
    model=model,
    tokenizer=tokenizer,
    dataset=calibration,
    recipe=recipe,
    num_calibration_samples=128,
    max_seq_length=4096,
    shuffle_calibration_samples=False,
    output_dir=f"{model_id.split('/')[-1]}-{recipe.split('/')[-1].removesuffix('.yaml')}",
)
test_ids = tokenizer(wikitext2_test_text(), add_special_tokens=False)["input_ids"]
print("WikiText-2 perplexity:", perplexity(model, test_ids, 4096))
