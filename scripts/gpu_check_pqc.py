"""Is the 1x1x1 post_quant_conv chunk-invariant on this GPU? (per-chunk vs whole-T)."""
import torch
from vaed.models import load_model
from vaed.patches import prepare_decoder, to_decoder_layout
for spec, shape in [("random:wan2.1", (1, 16, 21, 60, 104)), ("random:wan2.2", (1, 48, 31, 44, 80))]:
    for layout in ("contiguous", "channels_last"):
        vae = load_model(spec, "cuda", torch.bfloat16).vae
        prepare_decoder(vae, kernels="off", layout=layout)
        z = to_decoder_layout(torch.randn(shape, device="cuda", dtype=torch.bfloat16), layout)
        with torch.no_grad():
            full = vae.post_quant_conv(z)
            parts = torch.cat([vae.post_quant_conv(z[:, :, a:b]) for a, b in [(0, 1), (1, 4), (4, 9), (9, shape[2])]], 2)
            per = torch.cat([vae.post_quant_conv(z[:, :, i:i + 1]) for i in range(shape[2])], 2)
        print(spec, layout, "chunks equal:", torch.equal(full, parts), "per-frame equal:", torch.equal(full, per), flush=True)
