"""T5 in Equinox, and an importer for Mesh TensorFlow checkpoints.

The model needs only JAX and Equinox; reading TensorFlow checkpoints needs
TensorFlow (``pip install 'eqxckpt[tf]'``), imported only when you do.

```python
import eqxckpt.t5
model = eqxckpt.t5.load_tf("t5_v1_1_tiny")  # float32 unless dtype= says otherwise
logits = jax.vmap(model)(input_ids, decoder_input_ids, attention_mask=attention_mask)
```
"""

from ._config import T5Config as T5Config
from ._generate import GenerateOutput as GenerateOutput, generate as generate
from ._model import T5 as T5, relative_position_bucket as relative_position_bucket
from ._tf import convert_tf as convert_tf, load_tf as load_tf

__all__ = ["GenerateOutput", "T5", "T5Config", "convert_tf", "generate", "load_tf", "relative_position_bucket"]
