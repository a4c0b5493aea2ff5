"""Triton kernels for disaggregated prefill/decode: each op with a plain-torch reference (`<op>_ref`).

Import `pdkernels.ops` for the dispatching entry points; set TRITON_INTERPRET=1 before importing this
package to run the Triton kernels on a CPU.
"""
