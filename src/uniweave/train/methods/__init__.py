"""The built-in training methods, one package each (sft, grpo, opd): importing this
package registers their specs, in that order (`uniweave.config.methods`)."""

from uniweave.config.methods import register_builtins
from uniweave.train.methods.grpo.spec import SPEC as GRPO
from uniweave.train.methods.opd.spec import SPEC as OPD
from uniweave.train.methods.sft.spec import SPEC as SFT

register_builtins(SFT, GRPO, OPD)
