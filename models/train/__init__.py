"""Training of the tiny Kimi-architecture target and its EAGLE-3 draft (`python -m models.train`).

target: a byte-pair tokenizer learnt on the Python standard library's sources, then the Kimi-K2.5
        text model (MLA, MoE with sigmoid routing, dense layer 0, YaRN) trained on them; exported as
        a Kimi-layout checkpoint with compressed-tensors INT4 experts.
draft:  the EAGLE-3 draft trained on the target's aux hidden states and distribution over the target's
        own greedy continuations, with the training-time test (k unrolled steps); exported BF16.
Modules: corpus (text and split), bpe (tokenizer), nets (trainable modules), export (checkpoint
formats), loop (training and evaluation), cli (the command line).
"""
