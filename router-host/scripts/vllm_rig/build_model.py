"""Build the rig's tiny model into a directory, with nothing downloaded.

A byte-level BPE tokenizer trained here on generated text (vocab 2048, with a chat template), and
a 2-layer LlamaForCausalLM (hidden 128, 4 heads of 32: the CPU attention backend rejects a head
size of 16) with seeded random weights saved as safetensors. The engines load it as a normal
Hugging Face model directory; its outputs are gibberish, which is all the rig needs.

usage: build_model.py OUT_DIR
"""

import json
import os
import random
import sys

VOCAB_SIZE = 2048
MAX_MODEL_LEN = 2048
SEED = 1234

# Words for the training text and, in rig.py, for the prompts (the same distribution, so the
# tokenizer splits prompts into a few hundred tokens, not thousands).
WORDS = (
    "the a an of to in and is was for on with as by at from that this it be are or not have has "
    "router engine cache block token prefix session worker request reply model policy index "
    "event batch queue load latency memory page table key value hash shard replica cluster "
    "node rank stream chunk prompt context turn user assistant system message question answer "
    "river mountain forest city harbour garden library kitchen market station bridge island "
    "winter summer autumn spring morning evening night yesterday tomorrow always never often "
    "red blue green yellow black white silver golden bright quiet gentle sudden careful "
    "walk run read write build break carry open close follow measure compare explain describe "
    "one two three four five six seven eight nine ten hundred thousand first second last next"
).split()


def corpus(n_lines: int, rng: random.Random):
    for _ in range(n_lines):
        n = rng.randint(6, 30)
        line = " ".join(rng.choice(WORDS) for _ in range(n))
        yield line.capitalize() + rng.choice([".", "?", "!", ",", ";", ":"])
    # Digits and punctuation, so session ids and numbers in prompts stay short.
    for i in range(2000):
        yield f"session s{i} turn {i % 10} id-{i:04d} #{i}"


# Rendered by vLLM (Jinja2 with trim_blocks/lstrip_blocks) and by router-host's minijinja alike.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def build_tokenizer(out_dir: str) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(20000, random.Random(SEED)), trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="</s>",
        additional_special_tokens=specials[2:],
        model_max_length=MAX_MODEL_LEN,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    # Older transformers write the template to chat_template.jinja only; router-host's local
    # tokenizer reads tokenizer_config.json's `chat_template`, so make sure it is there too.
    cfg_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["chat_template"] = CHAT_TEMPLATE
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    return tok.get_vocab_size()


def build_weights(out_dir: str, vocab: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=MAX_MODEL_LEN,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out_dir, safe_serialization=True)


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    vocab = build_tokenizer(out_dir)
    build_weights(out_dir, vocab)
    print(f"built tiny model in {out_dir} (vocab {vocab})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
