// The helpers the op harness's case families share (op_harness_cases.h).
#include "tessel/kernels/op_harness_cases.h"

#include <limits>

#include "tessel/testing/gradcheck.h"

namespace tessel::kernels::harness::cases {

std::vector<float> normal(size_t n, uint64_t seed, float stddev) {
  return testing::random_normal(n, seed, stddev);
}

std::vector<float> nans(size_t n) {
  return std::vector<float>(n, std::numeric_limits<float>::quiet_NaN());
}

Output out_of(std::string name, const std::vector<float>& v) {
  return {std::move(name), std::vector<double>(v.begin(), v.end())};
}

Output zeros(std::string name, size_t n) {
  return {std::move(name), std::vector<double>(n, 0.0)};
}

void zero(Tensors& in, std::initializer_list<const char*> names) {
  for (const char* n : names)
    if (in.has(n)) std::fill(in.f(n).begin(), in.f(n).end(), 0.0f);
}

Label& Label::dim(const char* key, int64_t v) {
  dims += std::string("_") + key + std::to_string(v);
  shape += (shape.empty() ? "" : " ") + std::string(key) + "=" + std::to_string(v);
  return *this;
}

Label& Label::flag(const char* f) {
  dims += std::string("_") + f;
  shape += (shape.empty() ? "" : " ") + std::string(f);
  return *this;
}

OpCase make_case(Op op, Pass pass, const Label& label) {
  OpCase c;
  c.op = op;
  c.pass = pass;
  c.name = label.name();
  c.shape = label.shape;
  return c;
}

OpCase make_case(Op op, Pass pass, const Label& label, bool empty,
                 std::function<Tensors(uint64_t)> inputs, PassFns fns) {
  OpCase c = make_case(op, pass, label);
  c.empty = empty;
  c.make_inputs = std::move(inputs);
  c.run = std::move(fns.run);
  c.bounds = std::move(fns.bounds);
  return c;
}

GradSpec gradient(const PassFns& forward, Params params, std::function<void(Tensors&)> derive,
                  decltype(GradSpec::dependents) dependents,
                  decltype(GradSpec::third_derivative) third_derivative) {
  GradSpec g;
  g.forward = forward.run;
  g.forward_bounds = forward.bounds;
  g.weights = [](const Tensors& in) { return Outputs{out_of("out", in.f("dout"))}; };
  g.params = std::move(params);
  g.derive = std::move(derive);
  g.dependents = std::move(dependents);
  g.third_derivative = std::move(third_derivative);
  return g;
}

double affine(const Tensors&, std::string_view, size_t, double) {
  return 0.0;
}

void add_fwd_bwd(std::vector<OpCase>& out, Op op, Label label, bool empty,
                 const std::function<Tensors(uint64_t)>& inputs, PassFns fwd, PassFns bwd,
                 std::optional<GradSpec> grad) {
  label.what = "fwd";
  out.push_back(make_case(op, Pass::forward, label, empty, inputs, std::move(fwd)));
  label.what = "bwd";
  OpCase c = make_case(op, Pass::backward, label, empty, inputs, std::move(bwd));
  c.grad = std::move(grad);
  out.push_back(std::move(c));
}

}  // namespace tessel::kernels::harness::cases
