"""The ServerlessT2I Python SDK: write ModelFns, compose workflows, register and call them.

::

    from libs.sdk import ModelFn, Workflow, Param, register

    class Sharpen(ModelFn):                      # ships to executors as an installed package,
        fn_name = "acme.sharpen"                 # registered under the entry-point group
        def setup_io(self):                      # "serverless_t2i.modelfns"
            self.add_input("image")
            self.add_output("image")
        def execute(self, components, image):
            ...

    with Workflow("acme-flux", params={...}) as wf:  # compose as in the paper's Fig. 7
        ...
    register(wf, base_url="http://127.0.0.1:8000", api_key="sk-...")

Workflows travel as declarative specs; ModelFn code never goes over HTTP. The registry validates
the spec (ModelFns known, every input produced, acyclic, parameters typed with defaults).
"""

from libs.sdk.client import Client, SDKError, generate, register, register_lora
from libs.sdk.params import Param
from libs.workflow.compose import Outputs, Value, Workflow
from libs.workflow.modelfn import Deferred, ModelFn
from libs.workflow.spec import ParamSpec, WorkflowSpec

__all__ = [
    "Client",
    "Deferred",
    "ModelFn",
    "Outputs",
    "Param",
    "ParamSpec",
    "SDKError",
    "Value",
    "Workflow",
    "WorkflowSpec",
    "generate",
    "register",
    "register_lora",
]
