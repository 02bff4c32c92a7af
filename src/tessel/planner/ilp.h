// A mixed-integer linear programme (minimise c.x subject to lb <= A x <= ub, bounds and
// integrality on x), solved with COIN-OR CBC through its C interface. The graph planner's
// sharding and pipeline-cut models (issue 20) are built on it.
//
// Ilp is plain data (copyable, nothing allocated in CBC until solve()); solve() builds a fresh
// CBC model each time, so one Ilp can be solved under several options, and solves of different
// Ilps may run on different threads (CBC's C interface keeps its state in the model).
//
// What a solve reports, so a caller never mistakes a time-out for an answer:
//   optimal      a solution proven optimal (within relative_gap when that is > 0);
//   feasible     a solution, not proven optimal (the time limit came first);
//   infeasible   proven to have no solution;
//   no_solution  the time limit came before any solution was found.
// `bound` is CBC's best lower bound on the optimum (equal to `objective` when proven optimal),
// so objective - bound is the gap a feasible solution may still leave.
#pragma once

#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace tessel::planner {

inline constexpr double kIlpInfinity = std::numeric_limits<double>::infinity();

struct IlpOptions {
  double time_limit_s = 10;  // > 0
  // Stop once (best - bound) / |best| is at most this (0: prove optimality).
  double relative_gap = 0;
  // A solution to start from (CBC's MIP start): (variable, value) for the integer variables
  // that are not 0; CBC completes the rest and ignores a start that is not feasible.
  std::vector<std::pair<int, double>> start = {};
  // Branch and bound on the LP alone: no presolve, preprocessing, cuts or primal heuristics. For
  // formulations whose LP is (nearly) integral, where those only cost time: the sharding
  // programmes' tight edge formulation (sharding_programme.h) solves 4-10x faster so.
  bool plain = false;
};

enum class IlpStatus { optimal, feasible, infeasible, no_solution };
const char* ilp_status_name(IlpStatus s);

struct IlpResult {
  IlpStatus status = IlpStatus::no_solution;
  double objective = 0;        // of `values` (when there is a solution)
  double bound = 0;            // lower bound on the optimum
  std::vector<double> values;  // per variable; empty without a solution
  double seconds = 0;
  bool has_solution() const {
    return status == IlpStatus::optimal || status == IlpStatus::feasible;
  }
  // The value of binary or integer variable `var`, rounded (solvers leave 1e-9 residues).
  int64_t integer(int var) const;
};

class Ilp {
 public:
  using Term = std::pair<int, double>;  // (variable, coefficient)

  // Variables: their index, in order from 0. Throws InvalidArgumentError for lb > ub, a NaN
  // cost or bound, an infinite cost, or a cost that lowers the objective without bound (a
  // negative cost needs a finite ub, a positive one a finite lb; so no programme is unbounded).
  int add_binary(const std::string& name, double cost = 0);
  int add_integer(const std::string& name, double lb, double ub, double cost = 0);
  int add_continuous(const std::string& name, double lb, double ub, double cost = 0);

  // lb <= sum(coef * x) <= ub (either side may be infinite, not both). Throws
  // InvalidArgumentError for an unknown variable, a repeated one, a non-finite coefficient or
  // lb > ub.
  void add_constraint(std::span<const Term> terms, double lb, double ub,
                      const std::string& name = "");
  void add_le(std::span<const Term> terms, double ub, const std::string& name = "") {
    add_constraint(terms, -kIlpInfinity, ub, name);
  }
  void add_ge(std::span<const Term> terms, double lb, const std::string& name = "") {
    add_constraint(terms, lb, kIlpInfinity, name);
  }
  void add_eq(std::span<const Term> terms, double rhs, const std::string& name = "") {
    add_constraint(terms, rhs, rhs, name);
  }

  int variables() const { return int(vars_.size()); }
  int constraints() const { return int(rows_.size()); }

  // Throws InvalidArgumentError for a time limit <= 0 or a negative gap; ConfigError when the
  // problem has no variable.
  IlpResult solve(const IlpOptions& options = {}) const;

 private:
  struct Var {
    std::string name;
    double lb, ub, cost;
    bool integer;
  };
  struct Row {
    std::string name;
    std::vector<int> cols;
    std::vector<double> coefs;
    double lb, ub;
  };
  int add_var(const std::string& name, double lb, double ub, double cost, bool integer);

  std::vector<Var> vars_;
  std::vector<Row> rows_;
};

}  // namespace tessel::planner
