"""A Llama checkpoint with a mixture of experts in every block, as Hugging Face's Mixtral.

Mixtral (Jiang et al. 2024, "Mixtral of Experts") is Llama's stack with each feed-forward
replaced by a sparse mixture: a router ``gate`` (a bias-free linear map d -> E), a softmax over
all E experts, the top ``num_experts_per_tok`` kept and their weights renormalised to sum to
one, each expert a SwiGLU ``w2(silu(x w1) * (x w3))``.  minidist's mixture (minidist/model/moe.py)
with ``--arch llama --experts E --top-k k`` is that same function when:

* every block is a mixture (``moe_every`` 1): Mixtral has no dense blocks;
* nothing is dropped (``capacity_factor`` 0, dropless): Mixtral's experts take every token
  routed to them, where a capacity would leave some on the residual alone;
* ``top_k`` is at least 2: minidist's top-1 weight is the probability itself (Switch), where
  Mixtral would renormalise it to 1.

Anything else is refused in one line (:class:`ExportError`), since the
exported model would compute other logits.  The auxiliary losses change training, not the
logits: the load-balancing coefficient goes to ``router_aux_loss_coef``, the z-loss has no
field.

The weights are written under the names of Mixtral's released checkpoints, which
``MixtralForCausalLM.from_pretrained`` reads (transformers 5 fuses the experts into 3-d tensors
as it loads them): per layer ``model.layers.i.block_sparse_moe.gate.weight`` (E, d) -- minidist's
router (d, E) transposed -- and ``block_sparse_moe.experts.e.w1`` / ``w3`` / ``w2`` ``.weight``:
the gate and up halves of expert e's fused ``gate_up_proj`` (d, 2F) and its ``down_proj``
(F, d), each transposed to ``torch.nn.Linear``'s (out, in).  Attention, norms, embedding and
head are Llama's: export.py writes them and calls :func:`put_mixture` for each block's mixture
(this module imports nothing of export.py, so the two form no import cycle).
"""

from __future__ import annotations


class ExportError(ValueError):
    """A model Hugging Face's family cannot hold as it is (one line saying why)."""


def problems(model: dict) -> list[str]:
    """Why a minidist model config dict is not a Mixtral (one line each; [] when it is)."""
    out = []
    if model.get("arch") != "llama":
        out.append(f"a mixture of experts exports as Mixtral, which is Llama's architecture: this model is "
                   f"{model.get('arch')} (train with --arch llama)")
    if model.get("moe_every", 1) != 1:
        out.append(f"Mixtral has a mixture in every block: this model has one every {model['moe_every']} "
                   "(--moe-every 1)")
    if model.get("capacity_factor", 0):
        out.append(f"Mixtral drops no token: this model's capacity factor is {model['capacity_factor']} "
                   "(0 is dropless)")
    if model.get("top_k", 2) < 2:
        out.append(f"Mixtral renormalises its top-k weights, so top-{model['top_k']} routing would weigh "
                   "each expert 1: this model's top-1 weighs it by its probability (--top-k 2 or more)")
    return out


def check(model: dict) -> None:
    """Raise ExportError naming the first reason ``model`` is not a Mixtral, if any."""
    found = problems(model)
    if found:
        raise ExportError(f"cannot export as Mixtral: {found[0]}")


def mixtral_config(model: dict, llama: dict) -> dict:
    """The ``MixtralConfig`` (as a dict for config.json) of a minidist Llama config dict with
    experts, from its Llama config ``llama`` (export.llama_config)."""
    check(model)
    config = dict(llama)
    for key in ("attention_bias", "mlp_bias", "pretraining_tp"):  # Llama's fields; Mixtral has none
        config.pop(key)
    config.update({
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "num_local_experts": model["experts"],
        "num_experts_per_tok": model["top_k"],
        "output_router_logits": False,
        "router_aux_loss_coef": float(model.get("aux_loss_coef", 0.0)),
        "router_jitter_noise": 0.0,
        "sliding_window": None,  # every token attends to all before it, as minidist's
    })
    return config


def put_mixture(put, param, h: str, at: str, model: dict) -> None:
    """``put`` block ``h``'s (minidist's ``h.i.``) mixture under Mixtral's names for layer ``at``
    (``model.layers.i.``); ``param(name)``: minidist's array of that name."""
    moe, F = f"{at}block_sparse_moe.", model["ffn_hidden"]
    put(f"{moe}gate.weight", param(f"{h}mlp.router.weight").T)                     # (d, E) -> (E, d)
    for e in range(model["experts"]):
        gate_up = param(f"{h}mlp.experts.{e}.gate_up_proj.weight")                 # (d, 2F): [gate | up]
        put(f"{moe}experts.{e}.w1.weight", gate_up[:, :F].T)
        put(f"{moe}experts.{e}.w2.weight", param(f"{h}mlp.experts.{e}.down_proj.weight").T)
        put(f"{moe}experts.{e}.w3.weight", gate_up[:, F:].T)
