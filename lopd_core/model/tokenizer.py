"""Train the embedded base's tokenizer: byte-level BPE on the environments' own text.

Why train one: the pipeline must run offline with no hub download, and a vocabulary fitted to tool names, JSON
framing and instructions keeps sequences short for a tiny model on a CPU. Digits are split one per token so a
number the policy copies from an observation is copied digit by digit, whatever its value. The result is a
standard `PreTrainedTokenizerFast` with the chat template and the tool-call/experience special tokens, saved
next to the model so `AutoTokenizer.from_pretrained` loads it.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from lopd_core.model.chat import CHAT_TEMPLATE, IM_END, PAD, SPECIAL_TOKENS


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            # Words are split only before spaces (not at punctuation, as GPT-2's regex does), so frequent
            # pieces such as ` "arguments":` or ` "bank_get_balance",` become single tokens: a tool call
            # takes about 11 tokens instead of 23, which halves both training and rollout cost.
            # A newline is always a token of its own, so turn framing (`user` `\n`) ends on a token boundary
            # whatever follows: the latent teacher splices its latents there into the student's ids.
            pre_tokenizers.Split("\n", behavior="isolated"),
            pre_tokenizers.Split(" ", behavior="merged_with_next"),
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        pad_token=PAD,
        eos_token=IM_END,  # generation of one assistant turn stops at <|im_end|>
        bos_token=None,
        unk_token=None,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in (PAD, IM_END)],
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.model_max_length = 1 << 20
    return tokenizer
