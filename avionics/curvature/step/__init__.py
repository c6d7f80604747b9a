"""Curvature diagonals of the mini-batch mean loss from one captured, graph-keeping step.

Three diagonals h of the Hessian of L = mean_n l_n (docs/definitions.md, section 9), one
idea per module:

* :mod:`~avionics.curvature.step.ggn_diagonal`: ``"diag_ggn_exact"`` and ``"diag_ggn_mc"``,
  diag G = (1/N) sum_n sum_j (J_n^T S_n e_j)^2 from backpropagated columns of a square root
  S_n S_n^T = H_n of the loss Hessian w.r.t. each sample's output;
* :mod:`~avionics.curvature.step.loss_root`: that S_n, recognised from the graph of the
  per-sample losses (softmax cross-entropy and squared error, per sample or per token, with
  ignore_index, padding masks and a causal LM's shift) or factored densely;
* :mod:`~avionics.curvature.step.hessian_diagonal`: ``"diag_h"``, H_dd = e_d^T H e_d by
  Hessian-vector products, or diag G where the network is piecewise linear in each weight;
* :mod:`~avionics.curvature.step._autograd`: batched vector-Jacobian products and the error
  for a missing second derivative.
"""

VARIANTS = ("diag_h", "diag_ggn_exact", "diag_ggn_mc")
