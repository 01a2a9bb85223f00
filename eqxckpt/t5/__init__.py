"""T5 in Equinox: Mesh TensorFlow and HuggingFace weights in, generation, HuggingFace weights out.

The model needs only JAX and Equinox; reading TensorFlow checkpoints needs
TensorFlow (``pip install 'eqxckpt[tf]'``), imported only when you do.

```python
import eqxckpt.t5
model = eqxckpt.t5.load_tf("t5_v1_1_tiny")  # or load_hf("t5_v1_1_tiny/hf"); float32 unless dtype= says otherwise
logits = jax.vmap(model)(input_ids, decoder_input_ids, attention_mask=attention_mask)
out = eqxckpt.t5.generate(model, input_ids, attention_mask, max_new_tokens=32, num_beams=4)
eqxckpt.t5.save_hf("my-t5", model)  # config.json + model.safetensors, as HuggingFace writes them
```
"""

from ._config import T5Config as T5Config
from ._generate import GenerateOutput as GenerateOutput, generate as generate
from ._hf import convert_hf as convert_hf, load_hf as load_hf, save_hf as save_hf
from ._model import T5 as T5, relative_position_bucket as relative_position_bucket
from ._scan import scan as scan, unscan as unscan
from ._tf import convert_tf as convert_tf, load_tf as load_tf

__all__ = [
    "GenerateOutput",
    "T5",
    "T5Config",
    "convert_hf",
    "convert_tf",
    "generate",
    "load_hf",
    "load_tf",
    "relative_position_bucket",
    "save_hf",
    "scan",
    "unscan",
]
