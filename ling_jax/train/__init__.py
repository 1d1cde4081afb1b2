"""Training for the small demo model: corpus packing (corpus), tokenizer (bpe), token windows (data), the step
(step: target CE + NEXTN distillation + noaux_tc bias balancing) and the loop/CLI/export (trainer).

    python -m ling_jax.train --preset ling-demo --steps N --batch B --seq T --out DIR [--export models/ling-demo]
"""
