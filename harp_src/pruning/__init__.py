"""Structured-pruning baselines at a parameter budget, written for GQA/MQA: Mag-sp, Wanda-sp, FLAP, LLM-Pruner,
ShortGPT, attention-layer drop, and unstructured Wanda as the contrast.

`prune.prune(model, method, budget_params, calib_windows, scope)` scores units on calibration windows (enwiki train),
chooses what to remove, and really removes it (`slicing`): weights are sliced, a sub-layer left with nothing becomes
a `Constant` and stops using the KV cache. It returns a `PruneRecord`, a JSON-serialisable list of what each layer
keeps, which re-applies to the base model bit for bit. `prune.pruned_copy` gives the same pruned model as a copy and
leaves the model unchanged; where scoring does not change the model it scores before copying, which keeps the copy
and LLM-Pruner's gradients out of memory at the same time.

Methods (units: attention head groups or MQA query heads, and MLP channels; see `slicing`):
- mag-sp: ‖W_out[:, unit]‖₂ of the output projection the unit feeds (o_proj / down_proj). Uniform ratio, no data.
- wanda-sp: Σ_{j ∈ unit} mean_rows |W_out[:, j]| · ‖X_j‖₂. Uniform ratio; layer by layer, each scored on the
  outputs of the already-pruned layers below.
- flap: Σ_{j ∈ unit} Var(X_j) · ‖W_out[:, j]‖² (WIFV), standardised per layer and module, one global ranking; units
  are taken from the bottom of the ranking while they fit the budget, so each costs the parameters it frees.
  Removed inputs' calibration mean is folded into the output bias (W_out[:, removed] · E[X_removed]). Scored in one
  pass on the unpruned model (the global ranking needs every layer's scores before anything is removed).
- llm-pruner: block-wise, first-order Taylor Σ |w · ∂L/∂w| over a unit's weights (q/k/v rows and o columns; gate/up
  rows and down column), L = summed next-token NLL of the calibration windows. Uniform ratio over layers
  [round(4/32·L), L − round(2/32·L)): its Llama-7B defaults (layers 4..29 of 32) scaled to the model's depth.
- shortgpt: remove whole blocks with the lowest block importance BI = 1 − cos(x_in, x_out) (`analysis`).
- attn-drop-top / attn-drop-sim: remove whole attention sub-layers, the top N (= HARP with α = 0) or the N whose
  input and output are most alike (lowest BI of the attention sub-layer, as LLM-Drop).
- wanda: unstructured; in every decoder linear, per output row, the |W|·‖X‖-lowest weights are zeroed (the same
  share in every row), layer by layer. Nothing is removed: dense kernels run as before.

Uniform-ratio methods round the head share per layer: with 3 (SmolLM2) or 4 (Gemma-3) attention units per layer,
a ratio under 1/6 or 1/8 removes no head, and "heads+mlp" then equals "mlp".

Scopes: "heads+mlp" (the methods' original form) or "mlp" (MLP channels only, as the HARP authors' copies of FLAP,
Wanda-sp and Mag-sp run). Block and attention-layer methods have one scope each ("blocks", "attention"); wanda has
"linear".

Modules: `methods` (names, scopes, the request), `prune` (the registry and the entry), one module per method family
(`magnitude`, `wanda`, `flap`, `llm_pruner`, `layer_drop`), `calibration` and `selection` (what they share),
`budgets`, `record` (what was removed, re-applied bit for bit) and `slicing` (really removing structures).
"""
