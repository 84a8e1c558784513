"""The model the demo fine-tunes and bench/train_step times: a Hugging Face `transformers`
LlamaForCausalLM (the architecture most fine-tuning starts from: RMSNorm, rotary positions,
grouped-query attention, SwiGLU MLP, an untied head), random-initialized from a small config.
Byte tokens (a vocabulary of 256) so that any text trains it without downloading a tokenizer;
nothing is fetched from a hub.
"""
import torch
import transformers


def llama(layers, width, heads, context, vocab=256):
    """LlamaForCausalLM with `layers` decoder layers `width` wide, `heads` attention heads (half
    as many key-value heads when even) and an MLP 8/3 as wide, rounded up to 64."""
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=width, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads // 2 if heads % 2 == 0 else heads,
        intermediate_size=-(-8 * width // 3 // 64) * 64, max_position_embeddings=context,
        tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(config)


def loss_of(model, x, y):
    """The next-byte cross entropy of the model's logits for `x` against `y` (the model called
    with transformers' keyword arguments)."""
    logits = model(input_ids=x).logits
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                             y.reshape(-1))
