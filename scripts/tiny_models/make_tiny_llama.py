# From the project's shared engine tools (shared/engines/tools/make_tiny_llama.py), kept here so that a clean clone
# builds the same tiny models for the live vLLM tests. Run with the vLLM virtualenv's Python.
"""Make a tiny random-weights Llama chat model with a locally trained byte-level BPE tokenizer and a ChatML template."""

import glob
import os
import sys

out = sys.argv[1] if len(sys.argv) > 1 else "/models/tiny-llama"
os.makedirs(out, exist_ok=True)
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

files = (
    sorted(glob.glob("/usr/lib/python3*/**/*.py", recursive=True))[:400]
    or sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))[:400]
)
special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.post_processor = processors.ByteLevel(trim_offsets=False)
trainer = trainers.BpeTrainer(
    vocab_size=2048, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
)
tok.train(files, trainer)
from transformers import PreTrainedTokenizerFast

chat_template = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
hf = PreTrainedTokenizerFast(
    tokenizer_object=tok,
    bos_token="<|im_start|>",
    eos_token="<|im_end|>",
    unk_token="<|endoftext|>",
    pad_token="<|endoftext|>",
)
hf.chat_template = chat_template
hf.save_pretrained(out)
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)
cfg = LlamaConfig(
    vocab_size=len(hf),
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=2048,
    bos_token_id=hf.bos_token_id,
    eos_token_id=hf.eos_token_id,
    pad_token_id=hf.pad_token_id,
    tie_word_embeddings=False,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    dtype="bfloat16",
)
m = LlamaForCausalLM(cfg).to(torch.bfloat16)
m.save_pretrained(out, safe_serialization=True)
GenerationConfig(
    bos_token_id=hf.bos_token_id, eos_token_id=hf.eos_token_id, pad_token_id=hf.pad_token_id
).save_pretrained(out)
print("saved", out, "vocab", len(hf), "params", sum(p.numel() for p in m.parameters()))
print(os.listdir(out))
