"""restps from Python: the parameter-server HTTP contract of restps
(openapi/openapi.yaml) with numpy arrays in and out.

    import restps
    c = restps.Client("localhost:2222")          # one ps task
    params = c.pull()                            # {"hid_w": np.ndarray, ...}, .global_step
    c.push({"hid_w": g}, step=params.global_step, worker=1)

    cluster = restps.Cluster.from_tf_config()    # every ps task of TF_CONFIG's cluster

Errors are typed (restps.errors): HTTPError and its subclasses carry psd's
JSON error; NetworkError when no answer came after the retries."""
from .client import Client, Params
from .cluster import Cluster
from .errors import (BadRequest, Conflict, HTTPError, NetworkError, NotFound, PreconditionFailed, ProtocolError,
                     RestpsError, TLSError, TooLarge, Unauthorized, Unavailable)
from .safetensors_io import decode as decode_safetensors
from .safetensors_io import encode as encode_safetensors

__version__ = "0.1.0"
__all__ = ["Client", "Cluster", "Params", "RestpsError", "HTTPError", "NetworkError", "TLSError", "ProtocolError",
           "BadRequest", "Unauthorized", "NotFound", "Conflict", "PreconditionFailed", "TooLarge", "Unavailable",
           "encode_safetensors", "decode_safetensors"]
