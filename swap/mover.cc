#include "swap/mover.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/check.h"
#include "base/status.h"

namespace strata::swap {
namespace {

int I(Tier t) { return static_cast<int>(t); }
bool IsMemory(Tier t) { return t != Tier::kNvme; }

}  // namespace

Mover::Mover(const MoverParts& parts) : parts_(parts) {
  STRATA_CHECK(parts.table != nullptr && parts.device != nullptr && parts.host != nullptr &&
                   parts.copy != nullptr && parts.staging != nullptr,
               "Mover: a table, device and host resources, a copy engine and a staging pool");
}

Mover::~Mover() {
  MutexLock lock(&mu_);
  for (auto& [id, c] : copies_) {
    for (Tier t : {Tier::kDevice, Tier::kHost}) {
      if (c.at[I(t)] == nullptr) continue;
      if (t == Tier::kDevice) {
        for (auto& f : c.fences) f->Wait().IgnoreError();  // the kernels end first
      }
      ResourceFor(t).Deallocate(c.at[I(t)], c.bytes);
    }
  }
  for (HeldAside& h : held_aside_) {
    for (auto& f : h.fences) f->Wait().IgnoreError();
    parts_.device->Deallocate(h.at, h.bytes);
  }
}

void Mover::AddFence(PartitionId id, std::shared_ptr<tiering::Fence> fence) {
  if (fence == nullptr) return;
  MutexLock lock(&mu_);
  ReapLocked();
  auto it = copies_.find(id);
  if (it == copies_.end() || it->second.at[I(Tier::kDevice)] == nullptr) return;
  it->second.fences.push_back(std::move(fence));
}

uint64_t Mover::held_aside_bytes() const {
  MutexLock lock(&mu_);
  uint64_t bytes = 0;
  for (const HeldAside& h : held_aside_) bytes += h.bytes;
  return bytes;
}

absl::Status Mover::WaitForFences(PartitionId id) {
  std::vector<std::shared_ptr<tiering::Fence>> fences;
  {
    MutexLock lock(&mu_);
    auto it = copies_.find(id);
    if (it == copies_.end()) return absl::OkStatus();
    fences = it->second.fences;
  }
  for (auto& f : fences) STRATA_RETURN_IF_ERROR(f->Wait());
  MutexLock lock(&mu_);
  auto it = copies_.find(id);
  if (it == copies_.end()) return absl::OkStatus();
  std::erase_if(it->second.fences, [&](const std::shared_ptr<tiering::Fence>& f) {
    return std::find(fences.begin(), fences.end(), f) != fences.end();
  });
  return absl::OkStatus();
}

void Mover::FreeDeviceLocked(std::byte* at, uint64_t bytes,
                             std::vector<std::shared_ptr<tiering::Fence>> fences) {
  std::erase_if(fences, [](const std::shared_ptr<tiering::Fence>& f) { return f->Passed(); });
  if (fences.empty()) {
    parts_.device->Deallocate(at, bytes);
  } else {
    held_aside_.push_back({at, bytes, std::move(fences)});
  }
}

void Mover::ReapLocked() {
  std::erase_if(held_aside_, [&](HeldAside& h) {
    std::erase_if(h.fences, [](const std::shared_ptr<tiering::Fence>& f) { return f->Passed(); });
    if (!h.fences.empty()) return false;
    parts_.device->Deallocate(h.at, h.bytes);
    return true;
  });
}

tiering::MemoryResource& Mover::ResourceFor(Tier t) const {
  return t == Tier::kDevice ? *parts_.device : *parts_.host;
}

std::byte* Mover::Address(PartitionId id, Tier tier) const {
  if (!IsMemory(tier)) return nullptr;
  MutexLock lock(&mu_);
  auto it = copies_.find(id);
  return it == copies_.end() ? nullptr : it->second.at[I(tier)];
}

RoleNvmeBytes Mover::nvme_bytes_by_role() const {
  MutexLock lock(&mu_);
  return nvme_by_role_;
}

TierMatrix Mover::bytes_moved() const {
  MutexLock lock(&mu_);
  return bytes_moved_;
}

absl::Status Mover::Fill(const tiering::PartitionDesc& desc, Tier tier,
                         absl::Span<const std::byte> initial) {
  STRATA_CHECK(initial.empty() || initial.size() == desc.bytes, "Mover::Fill: initial bytes");
  if (tier == Tier::kNvme) {
    if (parts_.store == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("partition ", desc.id, ": no NVMe tier to place it in"));
    }
    STRATA_ASSIGN_OR_RETURN(StagingPool::Lease lease, parts_.staging->Take());
    auto batch = parts_.store->NewBatch();
    STRATA_RETURN_IF_ERROR(batch->StageChunked(
        desc.id, desc.bytes, lease.a(), lease.b(), [&](uint64_t off, absl::Span<std::byte> chunk) {
          if (initial.empty()) {
            std::memset(chunk.data(), 0, chunk.size());
          } else {
            std::memcpy(chunk.data(), initial.data() + off, chunk.size());
          }
          return absl::OkStatus();
        }));
    return batch->Commit();
  }
  STRATA_ASSIGN_OR_RETURN(void* p, ResourceFor(tier).Allocate(desc.bytes));
  auto* bytes = static_cast<std::byte*>(p);
  absl::Status filled;
  if (initial.empty()) {
    filled = Zeros(tier, bytes, desc.bytes);
  } else if (tier == Tier::kDevice) {
    filled =
        parts_.copy
            ->CopyAsync(bytes, initial.data(), desc.bytes, tiering::CopyDirection::kHostToDevice)
            .get();
  } else {
    std::memcpy(bytes, initial.data(), desc.bytes);
  }
  if (!filled.ok()) {
    ResourceFor(tier).Deallocate(bytes, desc.bytes);
    return filled;
  }
  MutexLock lock(&mu_);
  ReapLocked();
  Copies& c = copies_[desc.id];
  c.at[I(tier)] = bytes;
  c.bytes = desc.bytes;
  return absl::OkStatus();
}

absl::Status Mover::Zeros(Tier tier, std::byte* dst, uint64_t bytes) {
  if (tier == Tier::kDevice) return parts_.copy->ZeroAsync(dst, bytes).get();  // on the device
  std::memset(dst, 0, bytes);
  return absl::OkStatus();
}

absl::Status Mover::Bytes(PartitionId id, uint64_t bytes, Tier from, Tier to, std::byte* src,
                          std::byte* dst, bool zeros) {
  using tiering::CopyDirection;
  if (from == to) return zeros ? Zeros(to, dst, bytes) : absl::OkStatus();  // a fill
  if (from == Tier::kNvme && to == Tier::kDevice) {
    STRATA_ASSIGN_OR_RETURN(StagingPool::Lease lease, parts_.staging->Take());
    return parts_.store->GetChunked(
        id, lease.a(), lease.b(), [&](uint64_t off, absl::Span<const std::byte> chunk) {
          return parts_.copy
              ->CopyAsync(dst + off, chunk.data(), chunk.size(), CopyDirection::kHostToDevice)
              .get();
        });
  }
  if (from == Tier::kDevice && to == Tier::kNvme) {
    STRATA_ASSIGN_OR_RETURN(StagingPool::Lease lease, parts_.staging->Take());
    auto batch = parts_.store->NewBatch();
    STRATA_RETURN_IF_ERROR(batch->StageChunked(
        id, bytes, lease.a(), lease.b(), [&](uint64_t off, absl::Span<std::byte> chunk) {
          return parts_.copy
              ->CopyAsync(chunk.data(), src + off, chunk.size(), CopyDirection::kDeviceToHost)
              .get();
        }));
    return batch->Commit();
  }
  if (from == Tier::kNvme) return parts_.store->Get(id, {dst, bytes});  // to host
  if (to == Tier::kNvme) return parts_.store->Put(id, {src, bytes});    // from host
  return parts_.copy
      ->CopyAsync(dst, src, bytes,
                  to == Tier::kDevice ? CopyDirection::kHostToDevice : CopyDirection::kDeviceToHost)
      .get();
}

absl::Status Mover::Carry(PartitionId id, Tier from, Tier to, bool zeros) {
  STRATA_ASSIGN_OR_RETURN(const tiering::Residency r, parts_.table->Get(id));
  if (!r.move || r.move->first != from || r.move->second != to) {
    return absl::FailedPreconditionError(
        absl::StrCat("partition ", id, ": carry ", TierName(from), " -> ", TierName(to),
                     " without that move begun in the residency table"));
  }
  const uint64_t bytes = r.desc.bytes;
  const bool fill = from == to;
  auto fail = [&](absl::Status s) {
    parts_.table->EndMove(id, false).IgnoreError();
    return Annotate(s, fill ? absl::StrCat("zeros for partition ", id, " in ", TierName(to))
                            : absl::StrCat("move of partition ", id, " ", TierName(from), " -> ",
                                           TierName(to)));
  };
  if ((from == Tier::kNvme || to == Tier::kNvme) && parts_.store == nullptr) {
    return fail(absl::FailedPreconditionError("no NVMe tier"));
  }
  if (from == Tier::kDevice || to == Tier::kDevice) {
    // The trainer's kernels that may use the device copy end before it is read or overwritten.
    if (absl::Status s = WaitForFences(id); !s.ok()) return fail(s);
  }
  std::byte* src = fill ? nullptr : Address(id, from);
  std::byte* dst = Address(id, to);
  if (IsMemory(from) && src == nullptr && !fill) {
    return fail(absl::InternalError("the source copy has no memory"));
  }
  bool allocated = false;
  if (IsMemory(to) && dst == nullptr) {
    absl::StatusOr<void*> p = ResourceFor(to).Allocate(bytes);
    if (!p.ok()) return fail(p.status());
    dst = static_cast<std::byte*>(*p);
    allocated = true;
  }
  absl::Status moved = Bytes(id, bytes, from, to, src, dst, zeros);
  if (!moved.ok()) {
    if (allocated) ResourceFor(to).Deallocate(dst, bytes);
    return fail(moved);
  }
  {
    MutexLock lock(&mu_);
    ReapLocked();
    if (allocated) {
      Copies& c = copies_[id];
      c.at[I(to)] = dst;
      c.bytes = bytes;
    }
    if (!fill) {
      bytes_moved_[I(from)][I(to)] += bytes;
      if (from == Tier::kNvme || to == Tier::kNvme) {
        nvme_by_role_[static_cast<int>(r.desc.role)][to == Tier::kNvme ? 1 : 0] += bytes;
      }
    }
  }
  return parts_.table->EndMove(id, true);
}

absl::Status Mover::Drop(PartitionId id, Tier tier) {
  STRATA_RETURN_IF_ERROR(parts_.table->Drop(id, tier));
  if (!IsMemory(tier)) return absl::OkStatus();
  MutexLock lock(&mu_);
  ReapLocked();
  auto it = copies_.find(id);
  if (it != copies_.end() && it->second.at[I(tier)] != nullptr) {
    if (tier == Tier::kDevice) {
      FreeDeviceLocked(it->second.at[I(tier)], it->second.bytes, std::move(it->second.fences));
      it->second.fences.clear();
    } else {
      ResourceFor(tier).Deallocate(it->second.at[I(tier)], it->second.bytes);
    }
    it->second.at[I(tier)] = nullptr;
  }
  return absl::OkStatus();
}

void Mover::Forget(PartitionId id) {
  MutexLock lock(&mu_);
  ReapLocked();
  auto it = copies_.find(id);
  if (it == copies_.end()) return;
  Copies& c = it->second;
  if (c.at[I(Tier::kDevice)] != nullptr) {
    FreeDeviceLocked(c.at[I(Tier::kDevice)], c.bytes, std::move(c.fences));
  }
  if (c.at[I(Tier::kHost)] != nullptr) parts_.host->Deallocate(c.at[I(Tier::kHost)], c.bytes);
  copies_.erase(it);
}

}  // namespace strata::swap
