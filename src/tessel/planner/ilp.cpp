#include "tessel/planner/ilp.h"

#include <coin/Cbc_C_Interface.h>
#include <fmt/format.h>
#include <omp.h>

#include <chrono>
#include <cmath>
#include <memory>
#include <set>

#include "tessel/core/check.h"

namespace tessel::planner {

const char* ilp_status_name(IlpStatus s) {
  switch (s) {
    case IlpStatus::optimal:
      return "optimal";
    case IlpStatus::feasible:
      return "feasible";
    case IlpStatus::infeasible:
      return "infeasible";
    case IlpStatus::no_solution:
      return "no solution";
  }
  return "unknown";
}

int64_t IlpResult::integer(int var) const {
  TESSEL_CHECK(has_solution() && var >= 0 && size_t(var) < values.size(), InvalidArgumentError,
               "IlpResult::integer: variable {} of {} ({})", var, values.size(),
               ilp_status_name(status));
  return int64_t(std::llround(values[size_t(var)]));
}

int Ilp::add_var(const std::string& name, double lb, double ub, double cost, bool integer) {
  TESSEL_CHECK(!std::isnan(lb) && !std::isnan(ub) && lb <= ub && std::isfinite(cost),
               InvalidArgumentError,
               "Ilp: variable '{}' has bounds [{}, {}] and cost {}; need lb <= ub and a finite "
               "cost",
               name, lb, ub, cost);
  // With every cost bounded in the direction it lowers the objective, the objective is bounded
  // below: "infeasible" from CBC then means infeasible (its LP path reports an unbounded
  // programme as infeasible too).
  TESSEL_CHECK((cost >= 0 || std::isfinite(ub)) && (cost <= 0 || std::isfinite(lb)),
               InvalidArgumentError,
               "Ilp: variable '{}' with cost {} is unbounded in the direction that lowers the "
               "objective (bounds [{}, {}]); bound it",
               name, cost, lb, ub);
  vars_.push_back({name, lb, ub, cost, integer});
  return int(vars_.size()) - 1;
}

int Ilp::add_binary(const std::string& name, double cost) {
  return add_var(name, 0, 1, cost, true);
}

int Ilp::add_integer(const std::string& name, double lb, double ub, double cost) {
  return add_var(name, lb, ub, cost, true);
}

int Ilp::add_continuous(const std::string& name, double lb, double ub, double cost) {
  return add_var(name, lb, ub, cost, false);
}

void Ilp::add_constraint(std::span<const Term> terms, double lb, double ub,
                         const std::string& name) {
  TESSEL_CHECK(
      !std::isnan(lb) && !std::isnan(ub) && lb <= ub && (std::isfinite(lb) || std::isfinite(ub)),
      InvalidArgumentError,
      "Ilp: constraint '{}' has bounds [{}, {}]; need lb <= ub, one of them finite", name, lb, ub);
  Row row{name, {}, {}, lb, ub};
  std::set<int> seen;
  for (const auto& [var, coef] : terms) {
    TESSEL_CHECK(var >= 0 && var < variables(), InvalidArgumentError,
                 "Ilp: constraint '{}' names variable {} of {}", name, var, variables());
    TESSEL_CHECK(std::isfinite(coef), InvalidArgumentError,
                 "Ilp: constraint '{}' gives variable {} the coefficient {}", name, var, coef);
    TESSEL_CHECK(seen.insert(var).second, InvalidArgumentError,
                 "Ilp: constraint '{}' names variable {} twice; add the coefficients", name, var);
    if (coef == 0) continue;
    row.cols.push_back(var);
    row.coefs.push_back(coef);
  }
  rows_.push_back(std::move(row));
}

IlpResult Ilp::solve(const IlpOptions& o) const {
  TESSEL_CHECK(o.time_limit_s > 0 && o.relative_gap >= 0, InvalidArgumentError,
               "Ilp::solve: time limit {} s and relative gap {}; need a time limit > 0 and a gap "
               ">= 0",
               o.time_limit_s, o.relative_gap);
  TESSEL_CHECK(!vars_.empty(), ConfigError, "Ilp::solve: the problem has no variable");
  const auto t0 = std::chrono::steady_clock::now();
  std::unique_ptr<Cbc_Model, void (*)(Cbc_Model*)> model(Cbc_newModel(), Cbc_deleteModel);
  TESSEL_CHECK(model != nullptr, Error, "Ilp::solve: CBC could not make a model");
  Cbc_setLogLevel(model.get(), 0);
  {
    // The whole matrix at once, by columns: adding rows one by one makes CBC re-grow its matrix
    // with every row (a 2-axis mesh's segment programmes, some 10^4 variables each, spent a fifth
    // of their time there). CBC reads infinite bounds as unbounded, ranged rows as ranged.
    const int n = int(vars_.size());
    std::vector<CoinBigIndex> start(size_t(n) + 1, 0);
    for (const Row& r : rows_)
      for (int c : r.cols) ++start[size_t(c) + 1];
    for (int c = 0; c < n; ++c) start[size_t(c) + 1] += start[size_t(c)];
    std::vector<int> index(size_t(start.back()));
    std::vector<double> value(size_t(start.back()));
    std::vector<CoinBigIndex> fill(start.begin(), start.end() - 1);
    std::vector<double> row_lb, row_ub;
    for (size_t i = 0; i < rows_.size(); ++i) {
      const Row& r = rows_[i];
      for (size_t k = 0; k < r.cols.size(); ++k) {
        const auto at = size_t(fill[size_t(r.cols[k])]++);
        index[at] = int(i);
        value[at] = r.coefs[k];
      }
      row_lb.push_back(r.lb);
      row_ub.push_back(r.ub);
    }
    std::vector<double> col_lb, col_ub, cost;
    for (const Var& v : vars_) {
      col_lb.push_back(v.lb);
      col_ub.push_back(v.ub);
      cost.push_back(v.cost);
    }
    Cbc_loadProblem(model.get(), n, int(rows_.size()), start.data(), index.data(), value.data(),
                    col_lb.data(), col_ub.data(), cost.data(), row_lb.data(), row_ub.data());
    for (int c = 0; c < n; ++c)
      if (vars_[size_t(c)].integer) Cbc_setInteger(model.get(), c);
  }
  if (!o.start.empty()) {
    std::vector<int> cols;
    std::vector<double> values;
    for (const auto& [var, value] : o.start) {
      TESSEL_CHECK(var >= 0 && var < variables(), InvalidArgumentError,
                   "Ilp::solve: the start names variable {} of {}", var, variables());
      cols.push_back(var);
      values.push_back(value);
    }
    Cbc_setMIPStartI(model.get(), int(cols.size()), cols.data(), values.data());
  }
  Cbc_setMaximumSeconds(model.get(), o.time_limit_s);
  if (o.plain)
    for (const char* off : {"presolve", "preprocess", "cuts", "heuristics"})
      Cbc_setParameter(model.get(), off, "off");
  if (o.relative_gap > 0) Cbc_setAllowableFractionGap(model.get(), o.relative_gap);
  {
    // CBC's LP factorisation reaches OpenMP (through the OpenMP build of OpenBLAS): with more
    // than one thread that starts libgomp's thread pool in this process, and a child forked from
    // it later (the profiler's workers) deadlocks in its first parallel region. One thread here
    // starts no pool; the solve is sequential either way. (nthreads-var is per thread: other
    // threads' kernels keep theirs.)
    const int threads = omp_get_max_threads();
    omp_set_num_threads(1);
    Cbc_solve(model.get());
    omp_set_num_threads(threads);
  }

  IlpResult res;
  res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const int secondary = Cbc_secondaryStatus(model.get());
  TESSEL_CHECK(secondary != 7 && !Cbc_isContinuousUnbounded(model.get()), Error,
               "internal: CBC found the problem unbounded ({} variables, {} constraints) although "
               "every cost is bounded",
               variables(), constraints());
  TESSEL_CHECK(!Cbc_isAbandoned(model.get()), Error,
               "Ilp::solve: CBC abandoned the problem (numerical difficulties; {} variables, {} "
               "constraints)",
               variables(), constraints());
  // A programme without integer variables is an LP: CBC solves it without branching and keeps
  // its solution as the column solution, not as a best integer solution.
  const bool lp = Cbc_getNumIntegers(model.get()) == 0;
  const double* best =
      lp ? (Cbc_isProvenOptimal(model.get()) ? Cbc_getColSolution(model.get()) : nullptr)
         : Cbc_bestSolution(model.get());
  if (Cbc_isProvenInfeasible(model.get())) {
    res.status = IlpStatus::infeasible;
  } else if (best == nullptr) {
    res.status = IlpStatus::no_solution;
  } else {
    res.status = Cbc_isProvenOptimal(model.get()) || secondary == 2 ? IlpStatus::optimal
                                                                    : IlpStatus::feasible;
    res.values.assign(best, best + vars_.size());
    res.objective = 0;
    for (size_t i = 0; i < vars_.size(); ++i) res.objective += vars_[i].cost * res.values[i];
  }
  res.bound = Cbc_getBestPossibleObjValue(model.get());
  if (res.status == IlpStatus::optimal && o.relative_gap == 0) res.bound = res.objective;
  return res;
}

}  // namespace tessel::planner
