"""The GPT on a pipeline: cut into chunks, layers as executor phases, one step over a schedule.

Composes the model (fmoe) with the generic executor (fmoe.schedule); the model itself knows no schedule.
"""

from fmoe.gpt_state import LayerLoad as LayerLoad
from fmoe.gpt_state import update_gpt_state as update_gpt_state
from fmoe.pipeline.cut import ChunkSpec as ChunkSpec
from fmoe.pipeline.cut import cut_gpt as cut_gpt
from fmoe.pipeline.cut import holders as holders
from fmoe.pipeline.step import GPTProgram as GPTProgram
from fmoe.pipeline.step import PipelineStep as PipelineStep
from fmoe.pipeline.step import gpt_pipeline_step as gpt_pipeline_step
from fmoe.pipeline.step import gpt_program as gpt_program
from fmoe.pipeline.step import split_microbatches as split_microbatches
